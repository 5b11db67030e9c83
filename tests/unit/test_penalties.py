"""presence_penalty, frequency_penalty and logit_bias in the sampler: against Hugging Face's logits processors where
it has one, against OpenAI's documented formula where it has none; the plain greedy path untouched."""
import torch

from common.engine.request import Request, SamplingParams
from common.engine.penalties import adjusted_logits
from common.engine.sampler import Sampler

VOCAB = 16


def _apply_bias_and_penalties(row: torch.Tensor, request: Request) -> torch.Tensor:
    return adjusted_logits(row[None], [request])[0]


def _request(output, prompt=(0, 1), **sampling) -> Request:
    return Request("r", list(prompt), SamplingParams(temperature=0, **sampling), output_token_ids=list(output))


def test_presence_and_frequency_follow_openais_formula_over_the_output_only():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    output = [3, 3, 3, 7, 9, 9]
    row = _apply_bias_and_penalties(logits, _request(output, prompt=(3, 4, 5), presence_penalty=0.5,
                                                     frequency_penalty=-0.3))
    # https://platform.openai.com/docs/advanced-usage: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    expected = logits.clone()
    for j in range(VOCAB):
        c = output.count(j)
        expected[j] -= c * -0.3 + (1.0 if c > 0 else 0.0) * 0.5
    assert torch.allclose(row, expected)
    assert row[4] == logits[4]  # a prompt token the output never repeated keeps its logit


def test_logit_bias_equals_hfs_sequence_bias_for_single_tokens():
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    bias = {2: 5.0, 11: -100.0, 4: 0.25}
    expected = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[0, 1]]), logits.clone())
    assert torch.allclose(_apply_bias_and_penalties(logits[0], _request([], logit_bias=bias)), expected[0])


def test_bias_then_repetition_penalty_as_hf_chains_them():
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    request = _request([5, 6], prompt=(1, 5), logit_bias={5: 2.0, 8: -1.0}, repetition_penalty=1.3)
    chain = LogitsProcessorList([SequenceBiasLogitsProcessor({(5,): 2.0, (8,): -1.0}),
                                 RepetitionPenaltyLogitsProcessor(1.3)])
    expected = chain(torch.tensor([request.all_token_ids]), logits.clone())
    assert torch.allclose(_apply_bias_and_penalties(logits[0], request), expected[0])


def test_greedy_rows_with_and_without_adjustments_share_a_batch():
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 1.0
    plain = _request([9])
    biased = _request([9], logit_bias={4: 3.0})
    penalised = _request([9, 9], frequency_penalty=1.0)
    tokens = [t for t, _ in Sampler()(logits, [plain, biased, penalised])]
    assert tokens == [9, 4, 0]  # the penalised row's 9 falls to -1: the first of the zeros wins (torch's argmax)
    assert not plain.sampling.adjusts_logits and biased.sampling.adjusts_logits


def test_a_batch_penalised_at_once_equals_each_row_alone():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    requests = [_request([3, 3, 5], presence_penalty=0.4, frequency_penalty=0.7),
                _request([1, 9, 9, 9], prompt=(9, 2), repetition_penalty=1.4, logit_bias={2: -5.0}),
                _request([], logit_bias={7: 1.5, 8: -0.5}),
                _request([6, 6], frequency_penalty=-1.0, repetition_penalty=0.8)]
    together = adjusted_logits(logits, requests)
    for row, request in zip(range(4), requests):
        assert torch.allclose(together[row], _apply_bias_and_penalties(logits[row], request))
    assert torch.equal(adjusted_logits(logits[:1], requests[:1]), together[:1])
    assert not torch.equal(together, logits)


def test_logprobs_stay_those_of_the_raw_distribution():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    request = _request([], logit_bias={0: 50.0}, logprobs=True)
    ((token, lp),) = Sampler()(logits, [request])
    assert token == 0
    assert abs(lp.logprob - torch.log_softmax(logits[0], -1)[0].item()) < 1e-6
