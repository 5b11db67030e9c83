"""benchmarks/multi_turn.py's pure pieces: its conversations (deterministic, no two sharing a prefix, each turn's
request carrying the whole history), the think times, the percentiles and summaries, the working set, and the
side-by-side report's ratios and answer check."""
from __future__ import annotations

import statistics

import pytest

from benchmarks.multi_turn import Result, Turn, conversations, report, summarize, think_times, working_set_blocks


def test_conversations_are_deterministic_and_distinct_from_their_first_words():
    chats = conversations(4, 3)
    assert chats == conversations(4, 3) and chats != conversations(4, 3, seed=1)
    assert all(len(c.questions) == 3 for c in chats)
    firsts = {c.system.split(".")[0] for c in chats}
    assert len(firsts) == 4  # "You are assistant i": every prompt differs from its first sentence on


def test_a_turns_request_carries_every_earlier_question_and_answer_in_order():
    chat = conversations(1, 3)[0]
    assert chat.messages(0, []) == [{"role": "system", "content": chat.system},
                                    {"role": "user", "content": chat.questions[0]}]
    third = chat.messages(2, ["a1", "a2"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third[1:]] == [chat.questions[0], "a1", chat.questions[1], "a2", chat.questions[2]]


def test_think_times_are_seeded_within_half_either_side():
    pauses = think_times(3, 4, 2.0)
    assert pauses == think_times(3, 4, 2.0)
    assert all(1.0 <= p <= 3.0 for row in pauses for p in row) and len({p for row in pauses for p in row}) == 12


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    values = [10.0, 20.0, 30.0, 40.0]
    assert summarize([5.0]) == {"mean": 5.0, "p50": 5.0, "p90": 5.0}
    assert summarize(values) == {"mean": statistics.fmean(values), "p50": 25.0, "p90": pytest.approx(37.0)}


def _turn(conversation: int, turn: int, ttft: float, answer: str = "a", prompt: int = 40, completion: int = 10,
          cached: int = 0) -> Turn:
    return Turn(conversation, turn, ttft, answer, prompt, completion, cached)


def test_the_working_set_is_each_conversations_last_prompt_and_answer_in_blocks():
    turns = [_turn(0, 0, 1, prompt=20), _turn(0, 1, 1, prompt=50, completion=15), _turn(1, 0, 1, prompt=16,
                                                                                         completion=1)]
    assert working_set_blocks(turns, block_size=16) == 5 + 2  # 65 tokens, then 17


def test_the_report_puts_each_configuration_against_none_and_checks_the_answers():
    none = Result("none", 10.0, [_turn(0, 0, 300), _turn(0, 1, 600)], {"prefill-0": 0, "decode-0": 0})
    shared = Result("shared", 5.0, [_turn(0, 0, 300), _turn(0, 1, 100, cached=32)], {"prefill-0": 32, "decode-0": 0})
    other = Result("disk", 10.0, [_turn(0, 0, 300), _turn(0, 1, 300, answer="b")], {"prefill-0": 16, "decode-0": 0})
    assert shared.stats()["output_tok_s"] == 4.0 and shared.stats()["ttft_later_ms"]["mean"] == 100
    text = report([none, shared, other], pool_blocks=2)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "2.25x, 6.00x, 2.00x" in rows["shared"] and rows["shared"].endswith("| yes |")
    assert "32 of 80" in rows["shared"] and "| 32, 0 |" in rows["shared"]
    assert rows["disk"].endswith("| NO |")
    assert "working set 4 blocks of 16 tokens = 2.0x the device pool of 2 blocks" in text


def _args(**changes):
    import argparse

    defaults = dict(port=18471, metrics_port_base=18480, num_kv_blocks=64, dtype="float32", up_args="",
                    host_kv_cache_gb=2.0)
    return argparse.Namespace(**{**defaults, **changes})


def test_the_default_up_command_is_the_cpu_one_and_up_args_come_before_the_tiers(tmp_path):
    from benchmarks.multi_turn import up_command

    plain = up_command("none", _args(), tmp_path)
    assert plain[1:] == ["-m", "services", "up", "--http-port", "18471", "--router-port", "0",
                         "--metrics-port-base", "18480", "--num-kv-blocks", "64", "--dtype", "float32"]
    gpu = up_command("host+disk", _args(up_args="--device cuda --model '/m 3b' --load-format dummy",
                                        dtype="bfloat16", host_kv_cache_gb=1.5), tmp_path)
    assert gpu[len(plain):] == ["--device", "cuda", "--model", "/m 3b", "--load-format", "dummy",
                                "--host-kv-cache-gb", "1.5", "--disk-kv-cache-dir", f"{tmp_path}/host-disk",
                                "--disk-kv-cache-gb", "2"]
    assert up_command("host", _args(), tmp_path)[-2:] == ["--host-kv-cache-gb", "2"]


def test_answers_differ_by_their_token_count_too_and_empty_ones_are_said():
    none = Result("none", 1.0, [_turn(0, 0, 100, answer="", completion=32)])
    host = Result("host", 1.0, [_turn(0, 0, 50, answer="", completion=31)])
    text = report([none, host], pool_blocks=1)
    assert next(line for line in text.splitlines() if line.startswith("| host |")).endswith("| NO |")
    assert "1 of 1 answers of `none` are empty: for them only the token count is compared" in text
    assert "are empty" not in report([Result("none", 1.0, [_turn(0, 0, 100)])], pool_blocks=1)


def test_ignore_eos_is_asked_of_the_openai_door():
    import http.server
    import json
    import threading

    from benchmarks.chat_stream import stream_chat

    bodies = []

    class Door(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Door)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert stream_chat(server.server_port, "m", [], 4, ignore_eos=True).text == "hi"
        assert stream_chat(server.server_port, "m", [], 4).text == "hi"
    finally:
        server.shutdown()
        server.server_close()
    assert bodies[0]["ignore_eos"] is True and "ignore_eos" not in bodies[1]
