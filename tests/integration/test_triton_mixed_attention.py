"""A mixed step in the Triton attention (Triton's interpreter, on the CPU): prefill chunks beside decode rows, the
decode rows between and around them or all first (as the scheduler orders running decodes), a one-token prompt among
them, with and without a sliding window. The decode rows go through the decode kernel (each read and written at its
row), the chunks through the prefill kernel; together they must give the torch reference's attention. Then the same
steps in a whole-step graph's fixed launch shape (`StaticShape`): padded rows and decode entries must change no real
row and store no K/V, and one prefill program a head takes every tile in turn."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
from itertools import product
import numpy as np
import torch
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.attention_triton import DecodeTuning, StaticShape, TritonPagedAttention
torch.manual_seed(0)
cpu = torch.device("cpu")
tables = [[6, 1, 4, 0], [2, 7], [3, 8, 9], [5], [10, 11, 12]]
mixed = BatchLayout([1, 5, 1, 3, 1], [13, 3, 6, 0, 9], tables)  # decode rows first, between and last
one_token_prompt = BatchLayout([1, 1, 6], [11, 0, 4], [tables[0], tables[3], tables[4]])  # beside a decode row
leading = BatchLayout([1, 1, 5, 3], [13, 6, 3, 0], [tables[0], tables[2], tables[1], tables[3]])  # decode rows first
for layout, window in ((mixed, None), (one_token_prompt, None), (mixed, 4), (leading, None), (leading, 4)):
    t = sum(layout.query_lens)
    q, k, v = torch.randn(t, 8, 32), torch.randn(t, 2, 32), torch.randn(t, 2, 32)
    cache = torch.randn(2, 13, 4, 2, 32)
    torch_path = TorchPagedAttention(4, {window}, cpu)
    want = torch_path.forward(q, k, v, cache.clone(), torch_path.prepare(layout), scale=0.2, window=window)
    triton_path = TritonPagedAttention(4, {window}, cpu)
    meta = triton_path.prepare(layout)
    got = triton_path.forward(q, k, v, cache.clone(), meta, scale=0.2, window=window)
    decode_rows = meta.decode_rows.tolist() if meta.decode_rows is not None else []
    print((got - want).abs().max().item(), decode_rows, meta.tile_seq.tolist())
prefill_first = BatchLayout([5, 1, 3, 1], [3, 13, 0, 9], [tables[1], tables[0], tables[3], tables[4]])
# the decode kernel's sequences split (its partial results merged), then whole (one program stores each)
for (layout, window), tuning in product(((prefill_first, None), (mixed, 4), (leading, None)),
                                        (DecodeTuning(), DecodeTuning(target_programs=1))):
    t, seqs = sum(layout.query_lens), len(layout.query_lens)
    # 7 padded rows, more decode entries than the step has, one prefill program a head for every tile
    shape = StaticShape(t + 7, 6, 64, spare_tiles=0)
    q, k, v = torch.randn(t + 7, 8, 32), torch.randn(t + 7, 2, 32), torch.randn(t + 7, 2, 32)
    cache = torch.randn(2, 13, 4, 2, 32)
    torch_path = TorchPagedAttention(4, {window}, cpu)
    want_cache = cache.clone()
    want = torch_path.forward(q[:t], k[:t], v[:t], want_cache, torch_path.prepare(layout), scale=0.2, window=window)
    triton_path = TritonPagedAttention(4, {window}, cpu, tuning)
    a = triton_path.host_arrays(layout)
    packed, decode_tables = triton_path.pack_static(a, shape)
    slots = np.full(t + 7, -1, dtype=np.int64)
    slots[:t] = a["slots"]
    static_tables = torch.zeros(6, 5, dtype=torch.int32)
    static_tables[:seqs, :a["tables"].shape[1]] = torch.from_numpy(a["tables"])
    static_decode = torch.zeros(shape.decode_entries, 5, dtype=torch.int32)
    static_decode[:len(decode_tables), :decode_tables.shape[1]] = torch.from_numpy(decode_tables)
    meta = triton_path.static_metadata(torch.from_numpy(slots), torch.from_numpy(packed), static_tables, static_decode,
                                       shape)
    got_cache = cache.clone()
    got = triton_path.forward(q, k, v, got_cache, meta, scale=0.2, window=window)[:t]
    print((got - want).abs().max().item(), (got_cache - want_cache).abs().max().item(), shape.tile_programs,
          shape.decode_entries)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_mixed_steps_decode_rows_take_the_decode_kernel_and_match_the_reference():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"},
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(maxsplit=1) for line in result.stdout.splitlines()]
    assert len(lines) == 11, result.stdout
    assert all(float(error) < 1e-5 for error, _ in lines), result.stdout
    # which rows each kernel took: the decode rows by their place in the packed batch, the chunks' tiles by sequence
    assert [rows for _, rows in lines[:5]] == ["[0, 6, 10] [1, 3]", "[0, 1] [2]", "[0, 6, 10] [1, 3]",
                                               "[0, 1] [2, 3]", "[0, 1] [2, 3]"]
    # the whole-step graph's shape: the same K/V stored (padded rows' slots are -1), at 16-18 tokens with up to 6
    # sequences: one prefill program a head (for up to 2 tiles) and 6 decode entries, most of them padding
    assert [rows for _, rows in lines[5:]] == ["0.0 1 6"] * 6
