"""Draft tokens without a draft model (vLLM's prompt lookup, SGLang's n-gram speculation): guesses
of what a sequence says next, taken from what it has said or read already. The scheduler
(node_agent/engine/scheduler.py) plans them into a decoding row's step; the runner scores them all
in one forward and keeps the longest prefix the model itself would have produced
(node_agent/model/acceptance.py).

`NgramIndex`: per sequence, where each n-gram of its tokens (prompt and output) last occurred.
Its proposal: the tokens that followed the latest earlier occurrence of its last n tokens, the
longest n that matches first. Appending a token costs one dict write per n-gram size.

`DraftLength`: how many tokens a sequence drafts, following its acceptance (HF's assisted
generation heuristic): up by two after a step that accepted every draft token, down by one after
one that did not, within 1..`num_speculative_tokens`.
"""

from dataclasses import dataclass, field

NGRAM_SIZES = (6, 4, 3, 2, 1)  # the suffix lengths matched, longest first


@dataclass(eq=False)
class NgramIndex:
    """The latest earlier occurrence of every n-gram (n in NGRAM_SIZES) of a token list: the
    position of the token that followed it."""

    tokens: list[int] = field(default_factory=list)
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in NGRAM_SIZES:
                if end >= n:
                    self.follows[tuple(self.tokens[end - n: end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens."""
        end = len(self.tokens)
        for n in NGRAM_SIZES:
            if end > n and (start := self.follows.get(tuple(self.tokens[end - n:]))) is not None:
                return self.tokens[start: start + k]
        return []


@dataclass
class DraftLength:
    """A sequence's draft length, following its acceptance."""

    limit: int
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.limit

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.current = min(self.limit, self.current + 2) if accepted == drafted else max(1, self.current - 1)


@dataclass
class Drafter:
    """One sequence's speculation: its index and draft length."""

    index: NgramIndex
    length: DraftLength

    @classmethod
    def ngram(cls, tokens: list[int], limit: int) -> "Drafter":
        index = NgramIndex()
        index.extend(tokens)
        return cls(index, DraftLength(limit))

    def propose(self, room: int) -> list[int]:
        """At most `room` tokens (and the sequence's draft length) of guesses."""
        return self.index.propose(min(room, self.length.current)) if room > 0 else []

    def accepted(self, drafted: int, tokens: list[int]) -> None:
        """A step's outcome: `drafted` tokens verified, `tokens` kept (the accepted ones and the model's next)."""
        self.length.update(drafted, len(tokens) - 1)
        self.index.extend(tokens)


@dataclass
class SpeculationStats:
    """Counters from the engine's start (vLLM's spec_decode metrics)."""

    drafts: int = 0  # steps of a sequence that verified a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def count(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
