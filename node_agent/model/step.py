"""The records between the engine's scheduler and the model's runner: what one step runs
(`StepPlan`, built by node_agent/engine/scheduler.py with no tensor in it) and what it gave
(`StepResult`, token ids and numbers). They are the only seam between the two (vLLM v1's
SchedulerOutput and ModelRunnerOutput).

Rows: sequences occupy rows 0..n-1 of the runner's per-row state (sampling parameters, rope
offsets, linear-attention states, block tables), decoding rows first, then rows still reading
their prompt; the plan's moves keep them packed.

KV tiers (node_agent/engine/kv_tiers.py): before its forwards a step copies evicted blocks to host
slots (`offloads`), then host slots and disk payloads into the device blocks a prompt's prefix
continues in (`restores`, `loads`); after them it hands back the bytes of the blocks computed for the
disk tier (`saves`, `StepResult.saved`).
"""

from dataclasses import dataclass, field

from shared.wire import SamplingParams


@dataclass
class RowSetup:
    """A sequence takes `row`: its sampling parameters, and the tokens the penalties count."""

    row: int
    job: str
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # a preempted sequence's tokens so far (it resumes from them)
    seed: int | None
    adapter_slot: int = 0  # its LoRA adapter's device slot (0: the base)


@dataclass
class PrefillChunk:
    """The next `len(tokens)` tokens of a sequence, written from position `start`."""

    key: int  # the sequence's
    row: int
    job: str
    tokens: list[int]
    start: int
    samples: bool  # the chunk ends what the sequence has to read: its next token is sampled
    score_top: int | None = None  # prompt logprobs asked (with this many alternatives)
    following: list[int] = field(default_factory=list)  # the prompt tokens each position scores


@dataclass
class DecodeRow:
    row: int
    token: int  # the last token, fed at `position`
    position: int
    draft: list[int] = field(
        default_factory=list
    )  # guesses of the next tokens, fed after it (speculation)

    @property
    def width(self) -> int:
        """Positions the row scores this step: its token's and each draft token's."""
        return 1 + len(self.draft)


@dataclass
class StepPlan:
    moves: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src, dst) row moves, in order, first
    setups: list[RowSetup] = field(default_factory=list)
    tables: dict[int, list[int]] = field(
        default_factory=dict
    )  # row -> its blocks, for rows that changed
    adapter_loads: dict[int, str] = field(
        default_factory=dict
    )  # device slot -> the LoRA adapter to load there, before the rows that use it run
    rows: int = 0  # rows in use after the moves and setups
    decode: list[DecodeRow] = field(default_factory=list)  # rows 0..len-1
    prefill: list[PrefillChunk] = field(
        default_factory=list
    )  # contiguous rows after the decoding ones
    samples: list[int] = field(
        default_factory=list
    )  # sequence keys sampled, rows 0..len-1 in order
    sample_params: list[SamplingParams] = field(default_factory=list)  # theirs, in the same order
    sample_positions: list[int] = field(
        default_factory=list
    )  # each one's last position (its draw's noise)
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    loads: list[tuple[bytes, int]] = field(default_factory=list)  # (block payload, device block)
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, its hash) to disk

    @property
    def drafts(self) -> list[list[int]]:
        """Each sampled row's draft tokens, in `samples` order (none for the rows ending a prompt)."""
        return [d.draft for d in self.decode] + [[] for _ in self.samples[len(self.decode) :]]


@dataclass
class Sampled:
    token: int
    logprob: float | None = None  # when asked
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptScores:
    """Prompt logprobs of one chunk: for each position from `start`, the following prompt token's
    logprob and the best alternatives."""

    start: int
    tokens: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]


@dataclass
class StepResult:
    # in `StepPlan.samples` order, each row's new tokens: the draft tokens the model accepted, then
    # its own next token (just that one for a row without a draft)
    sampled: list[list[Sampled]] = field(default_factory=list)
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # by sequence key
    failed: dict[str, Exception] = field(
        default_factory=dict
    )  # jobs whose own work raised (an image, say)
    saved: list[bytes] = field(default_factory=list)  # the `StepPlan.saves` blocks' contents
