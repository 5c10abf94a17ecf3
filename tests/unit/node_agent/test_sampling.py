import math

import torch

from node_agent.sampling import Row, apply_min_p, apply_penalties, apply_top_k, apply_top_p, sample, token_logprobs
from shared.wire import SamplingParams


def row(**params) -> Row:
    return Row(params=SamplingParams(**params), prompt_ids=[1, 2], output_ids=[3, 3, 4], generator=None)


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()


def test_top_p_keeps_the_smallest_nucleus_and_always_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]]))
    out = apply_top_p(logits, torch.tensor([0.7, 0.01]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]
    assert torch.isinf(out[1]).tolist() == [False, True, True, True]


def test_min_p_scales_with_the_best_token():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    assert torch.isinf(apply_min_p(logits, torch.tensor([0.4]))).tolist() == [[False, False, True]]


def test_penalties():
    logits = torch.zeros(1, 6)
    logits[0, 1] = 2.0
    apply_penalties(logits, [row(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits[0, 1] == 1.0  # seen in the prompt: positive logit divided
    assert logits[0, 3] == -(0.5 + 2 * 0.25)  # twice in the output
    assert logits[0, 4] == -(0.5 + 0.25)
    assert logits[0, 5] == 0.0


def test_greedy_rows_take_argmax_and_bias_applies():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    out = sample(logits.clone(), [row(temperature=0), row(temperature=0, logit_bias={2: 10.0})])
    assert out.tolist() == [1, 2]


def test_seeded_rows_reproduce_whatever_their_neighbours():
    def draw(seed_rows):
        rows = []
        for seed in seed_rows:
            g = torch.Generator().manual_seed(seed) if seed is not None else None
            rows.append(Row(SamplingParams(temperature=1.0), [], [], g))
        return sample(torch.zeros(len(rows), 1000), rows).tolist()
    alone = draw([7])[0]
    assert draw([7, 3])[0] == alone
    assert draw([None, None, 7])[2] == alone


def test_logprobs_are_log_softmax_and_sorted():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    chosen, tops = token_logprobs(logits, torch.tensor([2]), 2)
    assert math.isclose(chosen[0], torch.log_softmax(logits, -1)[0, 2].item(), rel_tol=1e-6)
    assert [t for t, _ in tops[0]] == [2, 1]
