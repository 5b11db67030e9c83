"""greedy_tokens is argmax: the first of equal logits, a NaN as the largest, in float32 and bfloat16."""
import pytest
import torch

from common.engine.greedy import greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_equal_argmax_with_ties_and_nan(dtype):
    torch.manual_seed(0)
    logits = torch.randint(-2, 3, (64, 1000)).to(dtype)  # many ties in every row
    logits[3, 17] = float("nan")
    logits[5, 999] = float("inf")
    logits[7] = float("-inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 17 and greedy_tokens(logits)[7] == 0
    assert torch.equal(greedy_tokens(logits[0]), logits[0].argmax(dim=-1))  # one row, no batch dimension
