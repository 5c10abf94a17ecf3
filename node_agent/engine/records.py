"""What the engine core hands the output processor after each step: token ids and numbers, never
text or tensors. Plain msgspec Structs, so the same records serve the output processor in the
device's own thread (tests, the in-process bench) or across a pipe in the node's output process
(node_agent/serving/output_process.py), where detokenising, stop strings and publishing happen.

The core decides what needs no text: EOS and `stop_token_ids`, `max_tokens`, the grammar. The
output processor decides stop strings and hands those sequences back (`Engine.stop`)."""

import msgspec


class _Record(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class JobOpened(_Record):
    """A job the core took: its sequences' keys (in choice order) and what its text side needs."""

    job: str
    keys: list[int]
    prompt_tokens: int
    submitted_ms: float
    stops: list[str] = []
    first_prompt_token: int | None = None  # when the request asks for prompt logprobs


class TokenOut(_Record):
    """One sequence's token of this step; `finish`: the core ended the sequence with it
    (`stop` for EOS or a stop token id, which is not detokenised; `length` for max_tokens)."""

    key: int
    token: int
    finish: str | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] = []


class PromptScoresOut(_Record):
    """Prompt logprobs of one chunk of a sequence's prompt (node_agent/model/step.PromptScores)."""

    key: int
    start: int
    tokens: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]


class JobFailed(_Record):
    """A job whose own work raised on the device (its sequences are ended already)."""

    job: str
    code: str
    message: str


class StepOutput(_Record):
    time_ms: float  # when the step ended (first-token times)
    started_ms: (
        float  # when it began (admission times: a prompt prefilled in one step was admitted then)
    )
    opened: list[JobOpened] = []  # jobs added since the last step, before any of their tokens
    admitted: list[
        tuple[str, int]
    ] = []  # jobs whose sequences took rows this step, with their cached prompt tokens
    scores: list[PromptScoresOut] = []
    tokens: list[TokenOut] = []
    failed: list[JobFailed] = []
    held: list[
        tuple[str, int]
    ] = []  # prefix marks newly held by the cache, with the tokens they span
    dropped: list[str] = []  # prefix marks the cache no longer holds
    tiers: list[tuple[str, str]] = []  # prefix marks whose tier changed: device, host or disk

    @property
    def empty(self) -> bool:
        return not (
            self.opened
            or self.admitted
            or self.scores
            or self.tokens
            or self.failed
            or self.held
            or self.dropped
            or self.tiers
        )
