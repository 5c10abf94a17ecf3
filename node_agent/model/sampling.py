"""Next tokens for a batch of rows, on the device, in one pass.

Every sampling parameter lives in a per-slot tensor (`SlotSampling`), set when a sequence takes
a row and moved with it when rows are packed, so a step samples all rows with batched tensor
ops and ends with one device->host copy of the chosen ids. The helpers are small and pure over
[rows, vocab] float32 logits; `sample` composes them in the order vLLM and HF apply them: bias,
penalties, temperature, top-k, top-p, min-p, draw. Stages no row uses are skipped (`Stages`).

Draws are Gumbel-max over noise hashed from (row seed, position, token id): a row's tokens depend
only on its own seed and logits, never on its neighbours, and no per-row generator or
`torch.multinomial` call is needed (nor can one raise on a degenerate distribution).
"""

import random
from dataclasses import dataclass

import torch

from shared.wire import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (dividing by them overflows)
# Temperatures above float32's largest (Ollama's options bound none) are held as it: every token
# kept is as likely at either.
TEMPERATURE_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Stages:
    """Which stages any row of this batch needs."""

    bias: bool = False
    penalties: bool = False
    sampling: bool = False  # some row has temperature > 0
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False


def stages(params: list[SamplingParams]) -> Stages:
    sampled = [p for p in params if p.temperature >= GREEDY_BELOW]
    return Stages(
        bias=any(p.logit_bias for p in params),
        penalties=any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        ),
        sampling=bool(sampled),
        top_k=any(p.top_k > 0 for p in sampled),
        top_p=any(p.top_p < 1.0 for p in sampled),
        min_p=any(p.min_p > 0 for p in sampled),
    )


class SlotSampling:
    """Per-slot sampling state on the device: parameters, seeds, output token counts, the
    prompt's tokens (for the repetition penalty) and logit bias."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab = vocab
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.ones(slots, **f32)  # 0: greedy
        self.top_p = torch.ones(slots, **f32)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.min_p = torch.zeros(slots, **f32)
        self.repetition = torch.ones(slots, **f32)
        self.presence = torch.zeros(slots, **f32)
        self.frequency = torch.zeros(slots, **f32)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.counts = torch.zeros(slots, vocab, **f32)  # times each token was output
        self.in_prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(slots, vocab, **f32)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.repetition,
            self.presence,
            self.frequency,
            self.seed,
            self.counts,
            self.in_prompt,
            self.bias,
        ]

    def assign(
        self,
        row: int,
        params: SamplingParams,
        prompt_ids: list[int],
        seed: int | None,
        output_ids: list[int] = (),
    ) -> None:
        """Give row `row` to a sequence with these parameters (seed None: a random one) that has
        output `output_ids` so far (a preempted sequence resuming)."""
        greedy = params.temperature < GREEDY_BELOW
        values = {
            self.temperature: 0.0 if greedy else min(params.temperature, TEMPERATURE_MAX),
            self.top_p: params.top_p,
            self.top_k: params.top_k,
            self.min_p: params.min_p,
            self.repetition: params.repetition_penalty,
            self.presence: params.presence_penalty,
            self.frequency: params.frequency_penalty,
            self.seed: random.getrandbits(31) if seed is None else seed & 0x7FFFFFFF,
        }
        for tensor, value in values.items():
            tensor[row] = value
        self.counts[row] = 0
        if output_ids:
            self.counts[row].index_add_(
                0,
                torch.tensor(list(output_ids), device=self.counts.device),
                torch.ones(len(output_ids), device=self.counts.device),
            )
        self.in_prompt[row] = False
        if params.repetition_penalty != 1.0 and prompt_ids:
            self.in_prompt[row, torch.tensor(prompt_ids, device=self.in_prompt.device)] = True
        self.bias[row] = 0
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=self.bias.device)
            self.bias[row, ids] = torch.tensor(
                list(params.logit_bias.values()), device=self.bias.device
            )

    def move(self, src: int, dst: int) -> None:
        for tensor in self._tensors():
            tensor[dst] = tensor[src]

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just chosen, `tokens[i]` for row `rows[i]` (for presence/frequency penalties)."""
        self.counts.index_put_(
            (rows, tokens), torch.ones(tokens.shape[0], device=tokens.device), accumulate=True
        )


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """repetition (HF: over prompt and output), presence and frequency (OpenAI: over output)."""
    seen = in_prompt | (counts > 0)
    penalised = torch.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = torch.where(seen, penalised, logits)
    return logits - (counts > 0) * presence[:, None] - counts * frequency[:, None]


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, sorted_desc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k: [rows] ints, 0 = off. Returns the logits and their sorted values, both cut."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_desc.gather(-1, (k - 1)[:, None])
    beyond = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    return logits.masked_fill(logits < kth, float("-inf")), sorted_desc.masked_fill(
        beyond, float("-inf")
    )


def apply_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, sorted_desc: torch.Tensor
) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (always the best one)."""
    probs = sorted_desc.softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the better tokens
    keep_sorted = (before < top_p[:, None]) | (before == 0)
    lowest = torch.where(keep_sorted, sorted_desc, float("inf")).amin(
        -1, keepdim=True
    )  # the last kept logit
    return logits.masked_fill(logits < lowest, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1) from a hash of (seed, counter, token id): reproducible for
    one row whatever the batch around it. 31-bit arithmetic in int64 never overflows."""
    mask = 0x7FFFFFFF
    ids = torch.arange(vocab, device=seed.device)
    x = (((seed * 0x9E3779B1) & mask) + ((counter * 0x85EBCA77) & mask)) & mask
    x = x[:, None] ^ ids[None, :]
    for multiplier in (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F):
        x = ((x ^ (x >> 15)) * multiplier) & mask
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) / float(1 << 23)  # 23 bits: exact in float32, never 0 or 1


def shape(
    logits: torch.Tensor, slots: SlotSampling, rows: slice | torch.Tensor, use: Stages
) -> torch.Tensor:
    """The logits each row draws from ([rows, vocab] float32; row i's parameters are slot
    `rows[i]`'s): bias and penalties, then, where some row samples, temperature (1 for greedy
    rows), top-k, top-p, min-p. A greedy row's argmax is unchanged by the latter."""
    if use.bias:
        logits = logits + slots.bias[rows]
    if use.penalties:
        logits = apply_penalties(
            logits,
            slots.counts[rows],
            slots.in_prompt[rows],
            slots.repetition[rows],
            slots.presence[rows],
            slots.frequency[rows],
        )
    if not use.sampling:
        return logits
    temperature = slots.temperature[rows]
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if use.top_k or use.top_p:
        sorted_desc = logits.sort(dim=-1, descending=True).values
        if use.top_k:
            logits, sorted_desc = apply_top_k(logits, slots.top_k[rows], sorted_desc)
        if use.top_p:
            logits = apply_top_p(logits, slots.top_p[rows], sorted_desc)
    if use.min_p:
        logits = apply_min_p(logits, slots.min_p[rows])
    return logits


def gumbel(noise: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(noise))


def sample(
    logits: torch.Tensor, slots: SlotSampling, rows: slice, positions: torch.Tensor, use: Stages
) -> torch.Tensor:
    """Next token for each row of `logits` ([rows, vocab] float32); `positions` [rows] makes each
    draw's noise distinct per step."""
    shaped = shape(logits, slots, rows, use)
    greedy = shaped.argmax(-1)
    if not use.sampling:
        return greedy
    drawn = (shaped + gumbel(uniform_noise(slots.seed[rows], positions, logits.shape[-1]))).argmax(
        -1
    )
    return torch.where(slots.temperature[rows] > 0, drawn, greedy)


def token_logprobs(
    raw_logits: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens under the model, and the `top_n` best per row."""
    logprobs = raw_logits.float().log_softmax(-1)
    chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if top_n == 0:
        return chosen_lp, [[] for _ in chosen_lp]
    values, ids = logprobs.topk(top_n, dim=-1)
    return chosen_lp, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
