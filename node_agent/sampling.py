"""Turning a step's logits into next tokens, one row per sequence, batched where it can be.

Each helper is small and pure over a [rows, vocab] float32 tensor; `sample` composes them in
the order vLLM and HF apply them: bias, penalties, temperature, top-k, top-p, min-p, draw.
"""

from dataclasses import dataclass

import torch

from shared.wire import SamplingParams


@dataclass
class Row:
    """What sampling needs to know about one sequence."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None


def apply_logit_bias(logits: torch.Tensor, rows: list[Row]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(row.params.logit_bias.values()), device=logits.device)


def apply_penalties(logits: torch.Tensor, rows: list[Row]) -> None:
    """repetition (HF: over prompt and output), presence and frequency (OpenAI: over output)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=logits.device)
            scores = logits[i, seen]
            logits[i, seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            ids, counts = torch.tensor(row.output_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: [rows] ints, 0 = off."""
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (always the best one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def draw(probs: torch.Tensor, rows: list[Row], generator: torch.Generator | None) -> torch.Tensor:
    """One multinomial draw per row; seeded rows draw from their own generator."""
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if not seeded:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    out = torch.empty(len(rows), dtype=torch.long, device=probs.device)
    for i, row in enumerate(rows):
        out[i] = torch.multinomial(probs[i], 1, generator=row.generator or generator)[0]
    return out


def sample(logits: torch.Tensor, rows: list[Row], generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token for each row of `logits` ([rows, vocab], float32, modified in place)."""
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    greedy = torch.tensor([r.params.temperature == 0 for r in rows], device=logits.device)
    if greedy.all():
        return logits.argmax(-1)
    temperature = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device)
    logits = logits / temperature[:, None]
    if any(r.params.top_k > 0 for r in rows):
        logits = apply_top_k(logits, torch.tensor([r.params.top_k for r in rows], device=logits.device))
    if any(r.params.top_p < 1.0 for r in rows):
        logits = apply_top_p(logits, torch.tensor([r.params.top_p for r in rows], device=logits.device))
    if any(r.params.min_p > 0 for r in rows):
        logits = apply_min_p(logits, torch.tensor([r.params.min_p for r in rows], device=logits.device))
    drawn = draw(logits.softmax(-1), rows, generator)
    return torch.where(greedy, logits.argmax(-1), drawn)


def token_logprobs(raw_logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens under the model, and the `top_n` best per row."""
    logprobs = raw_logits.float().log_softmax(-1)
    chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if top_n == 0:
        return chosen_lp, [[] for _ in chosen_lp]
    values, ids = logprobs.topk(top_n, dim=-1)
    return chosen_lp, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
