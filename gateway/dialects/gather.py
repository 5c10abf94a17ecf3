"""Gather a job's events into whole choices (responses that are not streamed), and what an
embedding or rerank job's done event gathers into."""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from shared.wire import DeltaEvent, DoneEvent, PromptLogprob, TokenLogprob, Usage


@dataclass
class GatheredChoice:
    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None
    stop_sequence: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class Gathered:
    choices: list[GatheredChoice]
    usage: Usage


async def gather_choices(events: AsyncIterator[DeltaEvent | DoneEvent], n: int) -> Gathered:
    """Fold every delta into its choice (by `index`) until the job's `done` event."""
    choices = {i: GatheredChoice(index=i) for i in range(n)}
    async for event in events:
        if isinstance(event, DoneEvent):
            return Gathered(choices=[choices[i] for i in sorted(choices)], usage=event.usage)
        for delta in event.choices:
            choice = choices.setdefault(delta.index, GatheredChoice(index=delta.index))
            choice.parts.append(delta.text)
            choice.prompt_logprobs = delta.prompt_logprobs or choice.prompt_logprobs
            if delta.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + delta.logprobs
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            choice.stop_sequence = delta.stop_sequence or choice.stop_sequence
    raise RuntimeError("the job's events ended without a done event")


# What an embedding or rerank job's done event gathers into (gateway/jobs/pooling.py).
@dataclass
class Embedded:
    vectors: list[np.ndarray]  # float32, one per input, in order
    prompt_tokens: int


@dataclass
class Scored:
    scores: list[float]  # one per pair, in order
    prompt_tokens: int
    job: str  # the job's id (a response's id is made of it)
