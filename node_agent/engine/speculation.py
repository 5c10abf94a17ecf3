"""Draft tokens without a draft model (vLLM's prompt lookup, SGLang's n-gram speculation): guesses
of what a sequence says next, taken from what it has said or read already. The scheduler
(node_agent/engine/scheduler.py) plans them into a decoding row's step; the runner scores them all
in one forward and keeps the longest prefix the model itself would have produced
(node_agent/model/acceptance.py).

`NgramIndex`: where each n-gram of a token list last occurred. A sequence's own (prompt and
output) proposes what followed the latest earlier occurrence of its last n tokens, the longest n
that matches first ("ngram"). Appending a token costs one dict write per n-gram size.

`RecentOutputs` ("suffix", after Snowflake's suffix decoding, without its suffix tree): a model's
recent outputs in one bounded index, which a sequence also looks its last tokens up in: a reply
that repeats an earlier one (the same tool call, the same JSON a turn later) is guessed from it.
The longer match of the two wins, the sequence's own on a tie.

`DraftLength`: how many tokens a sequence drafts, following its acceptance (HF's assisted
generation heuristic): up by two after a step that accepted every draft token, down by one after
one that did not, within 1..`num_speculative_tokens`.
"""

from dataclasses import dataclass, field

NGRAM_SIZES = (6, 4, 3, 2, 1)  # the suffix lengths matched, longest first
SEPARATOR = -1  # between outputs in RecentOutputs: no token id, so no match runs across it


@dataclass(eq=False)
class NgramIndex:
    """The latest earlier occurrence of every n-gram (n in NGRAM_SIZES) of a token list: the
    position of the token that followed it."""

    tokens: list[int] = field(default_factory=list)
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in (
                NGRAM_SIZES if token != SEPARATOR else ()
            ):  # an output's end is no occurrence to follow
                if end >= n:
                    self.follows[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def match(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """The longest n whose last n tokens of `context` occurred here with a token after them,
        and up to `k` tokens that followed their latest occurrence; (0, []) when none did."""
        for n in NGRAM_SIZES:
            if len(context) >= n and (start := self.follows.get(tuple(context[-n:]))) is not None:
                following = self.tokens[start : start + k]
                return n, following[
                    : following.index(SEPARATOR)
                ] if SEPARATOR in following else following
        return 0, []


@dataclass(eq=False)
class RecentOutputs:
    """A model's recent outputs, one after another (SEPARATOR between them), indexed: at most
    `limit` tokens; when full, the older half is dropped (the index rebuilt from the rest)."""

    limit: int = 1 << 16
    index: NgramIndex = field(default_factory=NgramIndex)

    def add(self, output: list[int]) -> None:
        if len(self.index.tokens) + len(output) + 1 > self.limit:
            kept = (self.index.tokens + output)[-(self.limit // 2) :]
            self.index = NgramIndex()
            self.index.extend(kept)
        else:
            self.index.extend(output)
        self.index.extend([SEPARATOR])


@dataclass
class DraftLength:
    """A sequence's draft length, following its acceptance."""

    limit: int
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.limit

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.current = (
                min(self.limit, self.current + 2)
                if accepted == drafted
                else max(1, self.current - 1)
            )


@dataclass
class Drafter:
    """One sequence's speculation: its index, its draft length, and its model's recent outputs
    where it looks there too ("suffix")."""

    index: NgramIndex
    length: DraftLength
    recent: RecentOutputs | None = None

    @classmethod
    def of(cls, tokens: list[int], limit: int, recent: RecentOutputs | None = None) -> "Drafter":
        index = NgramIndex()
        index.extend(tokens)
        return cls(index, DraftLength(limit), recent)

    def propose(self, room: int) -> list[int]:
        """At most `room` tokens (and the sequence's draft length) of guesses."""
        if room <= 0:
            return []
        k, tokens = min(room, self.length.current), self.index.tokens
        n, draft = self.index.match(tokens, k)
        if self.recent is not None and (found := self.recent.index.match(tokens, k))[0] > n:
            draft = found[1]
        return draft

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
