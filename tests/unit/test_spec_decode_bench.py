"""benchmarks/spec_decode.py without servers: its workloads are fixed by their index, the rewrite prompt holds the
text its answer repeats, and the report compares each config with `off` (TPOT the other way round: lower is
faster), acceptance from the counted drafts, and names the answers that differ."""
from benchmarks.spec_decode import Answer, Run, chat_prompt, report, rewrite_prompt


def test_workloads_are_the_same_for_every_config_and_the_rewrite_holds_its_text():
    assert rewrite_prompt(3) == rewrite_prompt(3) and rewrite_prompt(3) != rewrite_prompt(4)
    paragraph = rewrite_prompt(3).split("\n\n", 1)[1]
    assert len(paragraph.split()) > 60 and '"' in rewrite_prompt(3).split("\n\n")[0]
    assert chat_prompt(0) != chat_prompt(1)


def _run(config: str, tpot_s: float, texts: list[str], **acceptance) -> Run:
    answers = [Answer(0.05, tpot_s, [tpot_s, 3 * tpot_s], 11, t) for t in texts]
    return Run(config, "rewrite", 1, wall_s=2.0, answers=answers, acceptance=acceptance)


def test_the_report_compares_with_off_and_counts_acceptance():
    runs = [_run("off", 0.10, ["a", "b"]), _run("ngram", 0.05, ["a", "c"], draft_tokens=40.0, accepted_tokens=30.0,
                                                 drafts=10.0)]
    table = report(runs).splitlines()
    ngram = next(line for line in table if "| ngram |" in line)
    cells = [c.strip() for c in ngram.strip("|").split("|")]
    assert cells[3] == "11.0"  # 22 tokens over 2 s
    assert cells[5] == "50.00" and cells[7] == "1.00x, 2.00x"  # TPOT ms; vs off: tok/s, TPOT (off / it)
    assert cells[8] == "0.75" and cells[9] == "4.00" and cells[10] == "1 of 2"


def test_break_even_is_the_lowest_acceptance_at_which_a_draft_pays():
    from benchmarks.spec_decode import break_even_rate
    from common.engine.spec.acceptance import AcceptancePolicy

    # One draft costing a tenth of a plain step pays once 1 + a > 1.1; none pays where a draft costs a whole step.
    assert abs(break_even_rate(AcceptancePolicy.linear(4, 0.1)) - 0.1) <= 0.003
    assert break_even_rate(AcceptancePolicy.linear(4, 1.0)) is None


def test_draft_costs_time_the_proposal_and_the_verify_of_each_batch(tiny_llama):
    from benchmarks.spec_decode import draft_costs

    rows = draft_costs(tiny_llama, tiny_llama, 2, "cpu", dummy=False)
    assert [r["batch"] for r in rows] == [1, 8, 32]
    assert all(r["plain_ms"] > 0 and r["propose_ms"] > 0 and r["verify_ms"] > 0 and r["step_cost"] >= 1.0
               for r in rows)
