import math

import torch

from node_agent.model.sampling import (
    SlotSampling,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    sample,
    stages,
    token_logprobs,
    uniform_noise,
)
from shared.wire import SamplingParams

VOCAB = 1000


def slots_with(*params: dict, prompt_ids=(1, 2), seeds=None) -> SlotSampling:
    slots = SlotSampling(len(params), VOCAB, torch.device("cpu"))
    for row, p in enumerate(params):
        slots.assign(
            row, SamplingParams(**p), list(prompt_ids), (seeds or [None] * len(params))[row]
        )
    return slots


def draw(
    slots: SlotSampling, logits: torch.Tensor, params: list[dict], positions=None
) -> list[int]:
    rows = slice(0, logits.shape[0])
    at = torch.tensor(positions or [5] * logits.shape[0])
    return sample(logits, slots, rows, at, stages([SamplingParams(**p) for p in params])).tolist()


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    out, _ = apply_top_k(logits, torch.tensor([2, 0]), logits.sort(-1, descending=True).values)
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()


def test_top_p_keeps_the_smallest_nucleus_and_always_the_best():
    logits = torch.log(
        torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02], [0.1, 0.6, 0.2, 0.1]])
    )
    out = apply_top_p(
        logits, torch.tensor([0.7, 0.01, 0.0]), logits.sort(-1, descending=True).values
    )
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]
    assert torch.isinf(out[1]).tolist() == [False, True, True, True]
    assert torch.isinf(out[2]).tolist() == [
        True,
        False,
        True,
        True,
    ]  # top_p 0 (or underflowed): the best only


def test_min_p_scales_with_the_best_token():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    assert torch.isinf(apply_min_p(logits, torch.tensor([0.4]))).tolist() == [[False, False, True]]


def test_penalties():
    slots = slots_with(
        dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        prompt_ids=[1, 2],
    )
    slots.record(torch.tensor([0]), torch.tensor([3]))
    slots.record(torch.tensor([0]), torch.tensor([3]))
    slots.record(torch.tensor([0]), torch.tensor([4]))
    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = 2.0
    out = apply_penalties(
        logits,
        slots.counts[:1],
        slots.in_prompt[:1],
        slots.repetition[:1],
        slots.presence[:1],
        slots.frequency[:1],
    )
    assert out[0, 1] == 1.0  # seen in the prompt: positive logit divided
    assert out[0, 3] == -(0.5 + 2 * 0.25)  # twice in the output
    assert out[0, 4] == -(0.5 + 0.25)
    assert out[0, 5] == 0.0


def test_greedy_rows_take_argmax_and_bias_applies():
    params = [dict(temperature=0), dict(temperature=0, logit_bias={2: 10.0})]
    logits = torch.zeros(2, VOCAB)
    logits[:, 1] = 5.0
    logits[:, 2] = 1.0
    assert draw(slots_with(*params), logits, params) == [1, 2]


def test_underflowing_parameters_never_raise():
    params = [
        dict(temperature=1e-320),
        dict(temperature=1.0, top_p=1e-50),
        dict(temperature=1.0, repetition_penalty=1e-30),
    ]
    logits = torch.randn(3, VOCAB)
    out = draw(slots_with(*params), logits, params)
    assert out[0] == int(logits[0].argmax()) and out[1] == int(logits[1].argmax())
    assert 0 <= out[2] < VOCAB


def test_seeded_rows_reproduce_whatever_their_neighbours():
    logits = torch.zeros(3, VOCAB)
    params = [dict(temperature=1.0)] * 3
    alone = draw(slots_with(params[0], seeds=[7]), logits[:1], params[:1])[0]
    assert draw(slots_with(*params[:2], seeds=[7, 3]), logits[:2], params[:2])[0] == alone
    assert draw(slots_with(*params, seeds=[None, None, 7]), logits, params)[2] == alone
    assert draw(slots_with(params[0], seeds=[8]), logits[:1], params[:1])[0] != alone


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :3] = probs.log()
    slots = slots_with(dict(temperature=1.0), seeds=[1])
    counts = torch.zeros(3)
    for position in range(3000):
        counts[draw(slots, logits, [dict(temperature=1.0)], [position])[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_noise_is_uniform_in_the_open_interval():
    u = uniform_noise(torch.tensor([0, 2**31 - 1]), torch.tensor([0, 2**31 - 1]), 50_000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_rows_move_with_their_state():
    slots = slots_with(dict(temperature=0), dict(temperature=0.5, top_k=5, logit_bias={9: 1.0}))
    slots.move(1, 0)
    assert (
        float(slots.temperature[0]) == 0.5
        and int(slots.top_k[0]) == 5
        and float(slots.bias[0, 9]) == 1.0
    )


def test_logprobs_are_log_softmax_and_sorted():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    chosen, tops = token_logprobs(logits, torch.tensor([2]), 2)
    assert math.isclose(chosen[0], torch.log_softmax(logits, -1)[0, 2].item(), rel_tol=1e-6)
    assert [t for t, _ in tops[0]] == [2, 1]
