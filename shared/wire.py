"""Messages between the gateway and the nodes.

A job is one entry on `cortex:jobs:{model}`: readable top-level fields (`job`, `kind`, `model`,
`job_class`, `max_tokens`, `submitted_ms`, `channel` (where its events go), `streaming`, `request_id`,
`traceparent` when the request is traced) plus `body`, the msgpack of a `GenerationRequest` (or of a `PoolingRequest`, for the
kinds `embed` and `rerank`). Token events travel on
`cortex:events:{job}` as msgpack of one `Event`. Every message carries the wire version `v`; a part
refuses a version it does not speak.
"""

from typing import Any, ClassVar, Literal

import msgpack
import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import WIRE_VERSION


class WireError(ValueError):
    """A message this part cannot read (wrong version or shape)."""


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Fields added within a wire version: left off the wire at their defaults (`pack`), so a part of
    # the same version that predates them reads every message that does not use them, and refuses
    # (extra fields are forbidden) one that does.
    added_within_version: ClassVar[frozenset[str]] = frozenset()

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
    # Speculative decoding for this request (an extension): overrides the model's catalogue entry;
    # None: as the catalogue says (shared/catalog.py `speculative`, `num_speculative_tokens`).
    speculative: Literal["off", "ngram", "suffix"] | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)


# `chat_template_kwargs` keys that would change how a prompt is rendered or returned rather than
# what the template says; the gateway refuses them and nodes never pass them on.
RENDERING_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class GenerationRequest(Wire):
    """What a node needs to run one job; the gateway has already validated it."""

    added_within_version: ClassVar[frozenset[str]] = frozenset(
        {"cache_salt", "adapter", "adapter_source"}
    )

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
    # i-th `{"type": "image"}` part of the messages stands for `images[i]` (gateway/jobs/images.py).
    images: list[bytes] = []
    # The conversation's prefixes as the gateway names them (`shared.prefix_marks`): each mark with
    # the characters of the messages up to it. The node reports the marks its cache comes to hold.
    prefix_marks: list[tuple[str, int]] = []
    # What the node's prefix block hashes start from besides the model: prompts share cached blocks
    # (and prefix marks) only with prompts of the same salt. The gateway sets it from the request's
    # `cache_salt` and, under `prefix_cache_scope = "key"`, the API key (`shared.prefix_marks.salt`).
    cache_salt: str = ""
    # The LoRA adapter the job runs with on `model` (its base), as the catalogue or
    # /v1/load_lora_adapter names it; "": the base itself. A node without it loads it from
    # `adapter_source` (a folder of PEFT's files), or fails the job with why.
    adapter: str = ""
    adapter_source: str = ""


class PoolingRequest(Wire):
    """A job for an embedding or rerank model: its inputs, one forward pass's row each."""

    job: str
    model: str
    kind: Literal["embed", "rerank"]
    # embed: each input a text or the model's own token ids; rerank: the documents' texts
    inputs: list[str | list[int]]
    queries: list[str] = []  # rerank: each input's query (one per input), scored as a pair with it
    dimensions: int | None = (
        None  # embed: keep this many leading dimensions (Matryoshka), renormalised when it normalises
    )
    truncate: bool = False  # inputs longer than the model's context are cut (else refused: context_length_exceeded)


POOLING_KINDS = frozenset({"embed", "rerank"})  # `StreamEntry.kind`s whose body is a PoolingRequest


class StreamEntry(Wire):
    """The top-level fields of a job stream entry, as `redis-cli XRANGE` shows them."""

    job: str
    kind: str
    model: str
    job_class: str = "interactive"  # interactive | batch (shared/queues.py)
    max_tokens: int = 0
    submitted_ms: int
    channel: str  # the job's event channel, `cortex:events:{job}`
    request_id: str = ""  # the client's x-request-id, so node logs can name it
    streaming: int = (
        0  # 1: a client is streaming it (a lost node fails it); 0: it may be retried once
    )
    keep_alive_s: float | None = (
        None  # keep the model loaded at least this long after the job (Ollama's keep_alive)
    )
    retries: int = 0  # times the janitor put it back after its node was lost
    api_key: str | None = (
        None  # the API key (its name) whose budgets the job's tokens count against, where it ends
    )
    # the caller (its key's name; `admin`, `anonymous`) whose waiting room its jobs wait in: while
    # others' jobs wait, a node takes a caller with no job running on it beyond its slots (shared/queues.py)
    tenant: str | None = None
    # the W3C trace context of the gateway's request span, when traced (shared/tracing.py)
    traceparent: str | None = Field(
        None, pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
    )
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

    @staticmethod
    def channel_of(fields: dict[bytes, bytes]) -> str:
        """The channel of an entry that may not parse (its error event goes there all the same)."""
        return fields.get(b"channel", b"").decode(errors="replace")

    @staticmethod
    def job_of(fields: dict[bytes, bytes]) -> str:
        return fields.get(b"job", b"").decode(errors="replace")

    def request(self) -> GenerationRequest:
        return unpack(self.body, GenerationRequest)

    def pooling_request(self) -> PoolingRequest:
        return unpack(self.body, PoolingRequest)


class _Struct(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A part of an event: built by keyword only, so a misspelt field is a TypeError where it is
    built, and refused (a WireError) where it is read. Fields at their defaults stay off the wire
    (a delta of one token is half the bytes); an event itself always carries every field, `v` too."""


class TopLogprob(_Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob] = []


class PromptLogprob(_Struct, kw_only=True):
    """One prompt token's logprob (`SamplingParams.prompt_logprobs`)."""

    token: str
    logprob: float | None  # None for the prompt's first token: nothing precedes it
    top_logprobs: list[TopLogprob] = []


class ChoiceDelta(_Struct, kw_only=True):
    """One sequence's news in one engine step."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # On a choice's first delta when `SamplingParams.prompt_logprobs` is set: one per prompt token.
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None  # set on the choice's last delta
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did


class Usage(_Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those read from the node's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Pooled(_Struct, kw_only=True):
    """An embedding or rerank job's result, one entry per input in order."""

    vectors: list[bytes] = []  # embed: each input's vector, float32 little-endian
    scores: list[float] = []  # rerank: each document's relevance score
    forwards: int = 0  # the forward passes its inputs took (shared with other jobs' inputs)


class Timings(_Struct, kw_only=True):
    queue_ms: float = 0.0  # submitted -> admitted by an engine
    prefill_ms: float = 0.0  # admitted -> first token
    decode_ms: float = 0.0  # first token -> done


class _Event(_Struct, tag_field="type", omit_defaults=False, kw_only=True):
    """A job event; `type` (the tag) says which. Every event but a delta ends the job, except
    `start`, which opens it."""

    v: int = WIRE_VERSION

    @property
    def type(self) -> str:
        return self.__struct_config__.tag


class StartEvent(_Event, tag="start", kw_only=True):
    """Sent once the node has read the job's prompt and accepted it, before any token: the
    prompt's length (Anthropic's `message_start` reports it) and, for `echo` of a prompt of token
    ids, its text."""

    prompt_tokens: int
    prompt_text: str | None = None


class DeltaEvent(_Event, tag="delta", kw_only=True):
    choices: list[ChoiceDelta]


class DoneEvent(_Event, tag="done", kw_only=True):
    usage: Usage
    timings: Timings = msgspec.field(default_factory=Timings)
    node: str = ""
    pooled: Pooled | None = None  # an embedding or rerank job's result


class ErrorEvent(_Event, tag="error", kw_only=True):
    code: str
    message: str


class StoredEvent(_Event, tag="stored", kw_only=True):
    """In place of an event larger than the node's `max_event_bytes`: that event, packed, waits in
    the job's `Keys.result` hash under `field` (`size` bytes); the gateway reads it from there and
    goes on as if it had come itself (gateway/jobs/job.py). Pub/sub and event logs carry only this."""

    field: str
    size: int


Event = StartEvent | DeltaEvent | DoneEvent | ErrorEvent | StoredEvent
StepEvents = list[
    tuple[str, list[Event]]
]  # one engine step: (job id, its events in order) per job with news
_event_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)


def ends_job(events: list[Event]) -> bool:
    """Whether a job's events of one step end it."""
    return isinstance(events[-1], DoneEvent | ErrorEvent)


def joined_deltas(events: list[Event]) -> list[Event]:
    """`events` with each run of deltas made one delta: per choice (by `index`, in the order they
    first came), its texts, token ids and logprobs in order, its prompt logprobs and its end as
    the run gave them. What a client that does not stream gets is the same (a delta of several
    tokens is what speculation makes too)."""
    joined: list[Event] = []
    for event in events:
        if isinstance(event, DeltaEvent) and joined and isinstance(joined[-1], DeltaEvent):
            joined[-1] = DeltaEvent(choices=_joined_choices(joined[-1].choices + event.choices))
        else:
            joined.append(event)
    return joined


def _joined_choices(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    by_index: dict[int, ChoiceDelta] = {}
    for delta in deltas:
        into = by_index.get(delta.index)
        if into is None:
            by_index[delta.index] = msgspec.structs.replace(delta)
            continue
        into.text += delta.text
        into.token_ids = into.token_ids + delta.token_ids
        if delta.logprobs is not None:
            into.logprobs = (into.logprobs or []) + delta.logprobs
        into.prompt_logprobs = into.prompt_logprobs or delta.prompt_logprobs
        into.finish_reason = delta.finish_reason or into.finish_reason
        into.stop_sequence = delta.stop_sequence or into.stop_sequence
    return list(by_index.values())


def pack(message: BaseModel) -> bytes:
    added = getattr(message, "added_within_version", frozenset())
    unused = {
        name for name in added if getattr(message, name) == type(message).model_fields[name].default
    }
    return msgpack.packb(message.model_dump(mode="python", exclude=unused), use_bin_type=True)


def _version_error(got: Any) -> WireError:
    return WireError(f"wire version {got!r} is not {WIRE_VERSION}; upgrade the older part")


def _check_version(data: Any) -> None:
    if not isinstance(data, dict) or int(data.get("v", -1)) != WIRE_VERSION:
        raise _version_error(data.get("v") if isinstance(data, dict) else None)


def unpack(raw: bytes, model: type[BaseModel]) -> Any:
    data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    _check_version(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise WireError(f"bad {model.__name__}: {exc}") from exc


def pack_event(event: Event) -> bytes:
    return _event_encoder.encode(event)


class _Versioned(msgspec.Struct):
    """Any message's wire version, whatever else it holds."""

    v: Any = None


def unpack_event(raw: bytes) -> Event:
    try:
        event = _event_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise _refusal(raw, exc) from exc
    if event.v != WIRE_VERSION:
        raise _version_error(event.v)
    return event


def _refusal(raw: bytes, exc: msgspec.DecodeError) -> WireError:
    """Why an event was refused: another wire version (whose events may differ), else what is wrong with it."""
    try:
        got = msgspec.msgpack.decode(raw, type=_Versioned).v
    except msgspec.DecodeError:  # not a msgpack map at all
        got = WIRE_VERSION
    return _version_error(got) if got != WIRE_VERSION else WireError(f"bad event: {exc}")
