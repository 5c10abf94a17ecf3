"""Messages between the gateway and the nodes.

A job is one entry on `cortex:jobs:{model}`: readable top-level fields (`job`, `kind`, `model`,
`priority`, `max_tokens`, `submitted_ms`, `reply`, `request_id`) plus `body`, the msgpack of a
`GenerationRequest`. Token events travel on `cortex:events:{job}` as msgpack of one `Event`.
Every message carries the wire version `v`; a part refuses a version it does not speak.
"""

from enum import StrEnum
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared import WIRE_VERSION


class WireError(ValueError):
    """A message this part cannot read (wrong version or shape)."""


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: int = WIRE_VERSION


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = None  # None: up to the context
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    # Constrained decoding: an llguidance Lark grammar (JSON schemas as `%json {...}`) every
    # output must match; the gateway builds and validates it (response_format, forced tool calls).
    grammar: str | None = None
    # Logprobs of the prompt's tokens (`echo` with `logprobs` on /v1/completions), with this many
    # alternatives each; None: not wanted. The engine answers in `ChoiceDelta.prompt_logprobs`.
    prompt_logprobs: int | None = None


# `chat_template_kwargs` keys that would change how a prompt is rendered or returned rather than
# what the template says; the gateway refuses them and nodes never pass them on.
RENDERING_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class GenerationRequest(Wire):
    """What a node needs to run one job; the gateway has already validated it."""

    job: str
    model: str
    kind: Literal["chat", "completion", "count"]  # count: render and tokenise only (count_tokens)
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = {}
    add_generation_prompt: bool = True
    echo: bool = False  # the start event carries the prompt's text (for a prompt of token ids)
    sampling: SamplingParams = SamplingParams()
    # The messages' images, encoded (PNG, JPEG, WebP, GIF) and checked by the gateway, in order: the
    # i-th `{"type": "image"}` part of the messages stands for `images[i]` (gateway/images.py).
    images: list[bytes] = []


class StreamEntry(Wire):
    """The top-level fields of a job stream entry, as `redis-cli XRANGE` shows them."""

    job: str
    kind: str
    model: str
    priority: str = "interactive"
    max_tokens: int = 0
    submitted_ms: int
    reply: str
    request_id: str = ""  # the client's x-request-id, so node logs can name it
    stream: int = 0  # 1: a client is streaming it (a lost node fails it); 0: it may be retried once
    keep_alive_s: float | None = None  # keep the model loaded at least this long after the job (Ollama's keep_alive)
    retries: int = 0  # times the janitor put it back after its node was lost
    body: bytes

    def to_fields(self) -> dict[str, str | int | float | bytes]:
        return self.model_dump(exclude_none=True)

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> "StreamEntry":
        decoded = {k.decode(): (v if k == b"body" else v.decode()) for k, v in fields.items()}
        _check_version(decoded)
        try:
            return cls.model_validate(decoded)
        except ValidationError as exc:
            raise WireError(f"bad job entry: {exc}") from exc

    def request(self) -> GenerationRequest:
        return unpack(self.body, GenerationRequest)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class PromptLogprob(BaseModel):
    """One prompt token's logprob (`SamplingParams.prompt_logprobs`)."""

    token: str
    logprob: float | None  # None for the prompt's first token: nothing precedes it
    top_logprobs: list[TopLogprob] = []


class ChoiceDelta(BaseModel):
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # On a choice's first delta when `SamplingParams.prompt_logprobs` is set: one per prompt token.
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None  # set on the choice's last delta
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(BaseModel):
    queue_ms: float = 0.0  # submitted -> admitted by an engine
    prefill_ms: float = 0.0  # admitted -> first token
    decode_ms: float = 0.0  # first token -> done


class EventType(StrEnum):
    """What a job event says; every event but a delta ends the job, except `start`, which opens it."""

    START = "start"
    DELTA = "delta"
    DONE = "done"
    ERROR = "error"


StepEvents = list[tuple[str, list[dict]]]  # one engine step: (job id, its wire events in order) per job with news


def ends_job(events: list[dict]) -> bool:
    """Whether a job's events of one step (wire dicts, as the engine makes them) end it."""
    return events[-1]["type"] in (EventType.DONE, EventType.ERROR)


class StartEvent(Wire):
    """Sent once the node has read the job's prompt and accepted it, before any token: the
    prompt's length (Anthropic's `message_start` reports it) and, for `echo` of a prompt of token
    ids, its text."""

    type: Literal[EventType.START] = EventType.START
    prompt_tokens: int
    prompt_text: str | None = None


class DeltaEvent(Wire):
    type: Literal[EventType.DELTA] = EventType.DELTA
    choices: list[ChoiceDelta]


class DoneEvent(Wire):
    type: Literal[EventType.DONE] = EventType.DONE
    usage: Usage
    timings: Timings = Timings()
    node: str = ""


class ErrorEvent(Wire):
    type: Literal[EventType.ERROR] = EventType.ERROR
    code: str
    message: str


Event = Annotated[StartEvent | DeltaEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]
_event_adapter: TypeAdapter = TypeAdapter(Event)


def choice_delta(index: int, text: str, token: int, logprob: dict | None, finish_reason: str | None,
                 stop_sequence: str | None, prompt_logprobs: list[dict] | None = None) -> dict:
    """One sequence's news in one engine step, as a `ChoiceDelta` travels (built without pydantic:
    the engine makes one per running sequence per step)."""
    delta = {"index": index, "text": text, "token_ids": [token], "logprobs": [logprob] if logprob else None,
             "finish_reason": finish_reason, "stop_sequence": stop_sequence}
    if prompt_logprobs is not None:
        delta["prompt_logprobs"] = prompt_logprobs
    return delta


def delta_event(choices: list[dict]) -> dict:
    """A `DeltaEvent` as it travels."""
    return {"v": WIRE_VERSION, "type": EventType.DELTA, "choices": choices}


def pack(message: BaseModel | dict) -> bytes:
    data = message if isinstance(message, dict) else message.model_dump(mode="python")
    return msgpack.packb(data, use_bin_type=True)


def _check_version(data: Any) -> None:
    if not isinstance(data, dict) or int(data.get("v", -1)) != WIRE_VERSION:
        got = data.get("v") if isinstance(data, dict) else None
        raise WireError(f"wire version {got!r} is not {WIRE_VERSION}; upgrade the older part")


def unpack(raw: bytes, model: type[BaseModel]) -> Any:
    data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    _check_version(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise WireError(f"bad {model.__name__}: {exc}") from exc


def unpack_event(raw: bytes) -> StartEvent | DeltaEvent | DoneEvent | ErrorEvent:
    return parse_event(msgpack.unpackb(raw, raw=False, strict_map_key=False))


def parse_event(data: Any) -> StartEvent | DeltaEvent | DoneEvent | ErrorEvent:
    _check_version(data)
    try:
        return _event_adapter.validate_python(data)
    except ValidationError as exc:
        raise WireError(f"bad event: {exc}") from exc
