"""Which draft tokens the model accepts (speculative decoding's verification), on the device.

A speculating row scores its last token and each draft token in one forward: position j's logits
give the token after draft token j-1. The row keeps the longest run of draft tokens the model
accepts, then one token of its own from the position after that run: where a draft token was
refused, drawn in its place; after a fully accepted draft, drawn as any next token.

- Greedy rows (temperature 0) accept a draft token exactly when it is the argmax, so the output
  equals decoding without speculation token for token.
- Sampled rows run rejection sampling (Leviathan et al., 2023) with a one-hot draft distribution
  (the drafts are deterministic): draft token x is accepted with probability p(x) under the row's
  shaped distribution p (node_agent/model/sampling.py `shape`: temperature, top-k/p, min-p, bias,
  a grammar's mask); refused, the token is drawn from p with x removed and renormalised. Each
  position's outcome is then distributed as p exactly. The uniforms are the row's hashed noise at
  that position: column x decides the acceptance, the other columns' Gumbel draw the replacement,
  so the two are independent and a row's draws depend only on its seed.
"""

import torch

from node_agent.model.sampling import SlotSampling, Stages, gumbel, shape, uniform_noise

NO_DRAFT = -1  # a position whose next token has no guess (a row's last)


def verify(
    logits: torch.Tensor,
    slots: SlotSampling,
    rows: torch.Tensor,
    positions: torch.Tensor,
    drafts: torch.Tensor,
    use: Stages,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions P (`logits` [P, vocab] float32, of slot `rows[i]` at `positions[i]`, with the
    draft token `drafts[i]` to check there, or NO_DRAFT): whether each draft token is accepted, and
    the token each position emits (the draft token where accepted, else the model's own) [P]."""
    shaped = shape(logits, slots, rows, use)
    greedy = shaped.argmax(-1)
    drafted = drafts != NO_DRAFT
    guess = drafts.clamp(min=0)[:, None]
    if not use.sampling:
        accepted = drafted & (greedy == guess[:, 0])
        return accepted, torch.where(accepted, guess[:, 0], greedy)
    noise = uniform_noise(slots.seed[rows], positions, logits.shape[-1])
    p_guess = shaped.softmax(-1).gather(1, guess)[:, 0]
    residual = torch.where(drafted[:, None], shaped.scatter(1, guess, float("-inf")), shaped)
    drawn = (residual + gumbel(noise)).argmax(-1)
    sampled = slots.temperature[rows] > 0
    accepted = drafted & torch.where(
        sampled, noise.gather(1, guess)[:, 0] < p_guess, greedy == guess[:, 0]
    )
    return accepted, torch.where(accepted, guess[:, 0], torch.where(sampled, drawn, greedy))


def kept(accepted: list[bool], widths: list[int]) -> list[int]:
    """Per row (its `width` positions in turn): how many of its draft tokens it keeps, the run of
    accepted ones from its first."""
    out, start = [], 0
    for width in widths:
        run = 0
        while run < width - 1 and accepted[start + run]:
            run += 1
        out.append(run)
        start += width
    return out
