"""A mixed step in the Triton attention (Triton's interpreter, on the CPU): prefill chunks beside decode rows, the
decode rows between and around them or all first (as the scheduler orders running decodes: read and written in
place), a one-token prompt among them, with and without a sliding window. The decode
rows go through the decode kernel, the chunks through the prefill kernel; together they must give the torch
reference's attention."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import torch
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.attention_triton import TritonPagedAttention
TritonPagedAttention._upload = lambda self, array: torch.from_numpy(array)  # no pinned memory without a GPU
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
    print((got - want).abs().max().item(), decode_rows, meta.tile_seq.tolist(), meta.decode_leading)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_mixed_steps_decode_rows_take_the_decode_kernel_and_match_the_reference():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"},
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(maxsplit=1) for line in result.stdout.splitlines()]
    assert len(lines) == 5, result.stdout
    assert all(float(error) < 1e-5 for error, _ in lines), result.stdout
    # which rows each kernel took: the decode rows by their place in the packed batch, the chunks' tiles by sequence,
    # and how many leading rows the decode kernel read and wrote in place (0: gathered and scattered)
    assert [rows for _, rows in lines] == ["[0, 6, 10] [1, 3] 0", "[0, 1] [2] 2", "[0, 6, 10] [1, 3] 0",
                                           "[0, 1] [2, 3] 2", "[0, 1] [2, 3] 2"]
