"""Ollama API wire types (`/api/*`), named as Ollama's `api/types.go` names them, fields in its order.

Requests validate Ollama's types (a field this gateway does not know is ignored and logged once:
`gateway/dialects/protocol/lenient.py`) and convert themselves to the same `shared.wire.GenerationRequest`
the other dialects become: `options` → sampling, `format` ("json" or a JSON schema) → JSON output
decoded under a grammar, `tools` → OpenAI-style function tools (what Hugging Face chat templates
read), base64 `images` → image parts (checked by gateway/jobs/images.py), `think` → the template's
`enable_thinking` (and the answer's `<think>…</think>` comes back apart). A request with no
messages (or an empty prompt) only loads its model. `/api/generate` renders its prompt through the
model's chat template as a user turn (after `system`), unless `raw`. Streaming is the default, as
in Ollama.
"""

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from gateway.dialects.protocol.bounds import Int64, JsonSchema, KeepAlive, TopK, duration_s
from gateway.dialects.protocol.lenient import Lenient
from gateway.dialects.tools.grammars import Constraint, JsonOutput
from gateway.dialects.tools.thinking import ThinkingSplitter
from shared.wire import GenerationRequest, SamplingParams

API_VERSION = "0.13.0"  # the Ollama release whose API this follows (`/api/version`; Copilot Chat needs >= 0.6.4)
STOP_MAX = 16  # Ollama sets no limit; every stop string is scanned for at each token
TOP_LOGPROBS_MAX = 20

Think = bool | Literal["low", "medium", "high"]


# ---- requests ---------------------------------------------------------------------------------


class Options(Lenient):
    """The model options Cortex runs; any other (`num_gpu`, `mirostat`, `num_thread` …) is ignored and
    logged once. `num_ctx` is accepted: a replica's context is the catalogue's `max_model_len`."""

    num_ctx: Int64 | None = None
    seed: Int64 | None = None  # negative: a random seed, as Ollama's -1
    num_predict: Int64 | None = None  # -1 (forever) and -2 (fill the context): up to the context
    top_k: TopK | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    repeat_penalty: float | None = Field(None, gt=0, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stop: Annotated[list[str], Field(max_length=STOP_MAX)] | None = None

    def sampling(self, **fields: Any) -> SamplingParams:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed if self.seed is not None and self.seed >= 0 else None,
            "stop": self.stop,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "max_tokens": self.num_predict
            if self.num_predict is not None and self.num_predict > 0
            else None,
        }
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, **fields)


class ToolCallFunction(Lenient):
    index: int | None = None
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(Lenient):
    id: str | None = None
    function: ToolCallFunction


class Message(Lenient):
    """A chat turn, asked or answered. `thinking` in history is accepted and not shown to the model."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null (some clients send it beside tool calls) is empty
    thinking: str | None = None
    images: list[str] | None = None  # base64, without a data: prefix
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ToolFunction(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: ToolFunction


Format = Literal["", "json"] | JsonSchema


def _image_part(data: str) -> dict[str, Any]:
    """A base64 image as the image part gateway/jobs/images.py checks (pillow finds its format)."""
    return {"type": "image_url", "image_url": {"url": f"data:image/*;base64,{data}"}}


def _message_for_node(message: Message, at: int) -> dict[str, Any]:
    text = message.content or ""
    data: dict[str, Any] = {"role": message.role, "content": text}
    if message.images:  # images first, then the text: where Ollama puts them in the prompt
        data["content"] = [*map(_image_part, message.images), {"type": "text", "text": text}]
    if message.tool_calls:
        data["tool_calls"] = [
            {
                "id": call.id or f"call_{at}_{i}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_name:
        data["name"] = message.tool_name
    return data


class _GenerateInput(Lenient):
    """What `/api/chat` and `/api/generate` share."""

    model: str = Field(min_length=1)
    format: Format | None = None
    options: Options = Options()
    stream: bool = True
    keep_alive: KeepAlive = (
        None  # seconds, or "5m"/"1h": keep the model loaded at least this long after
    )
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=TOP_LOGPROBS_MAX)

    @property
    def keep_alive_s(self) -> float | None:
        return duration_s(self.keep_alive)

    def splitter(self) -> ThinkingSplitter | None:
        """What splits the answer's thinking from its content, when the request asked to think."""
        return ThinkingSplitter() if self.think else None

    @property
    def constraint(self) -> Constraint:
        if not self.format:
            return None
        return JsonOutput(None if self.format == "json" else self.format, "format")

    def _template_kwargs(self) -> dict[str, Any]:
        """`think` as the templates of thinking models read it (Qwen3's `enable_thinking`, gpt-oss's
        `reasoning_effort`); a template that reads neither is unaffected."""
        if self.think is None:
            return {}
        return {"enable_thinking": bool(self.think)} | (
            {"reasoning_effort": self.think} if isinstance(self.think, str) else {}
        )

    def _sampling(self) -> SamplingParams:
        return self.options.sampling(
            logprobs=self.logprobs or self.top_logprobs > 0, top_logprobs=self.top_logprobs
        )


class ChatRequest(_GenerateInput):
    messages: list[Message] = []  # none: only load the model (Ollama's way to preload one)
    tools: list[Tool] | None = None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools)

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        return GenerationRequest(
            job=job,
            model=model,
            kind="chat",
            messages=[_message_for_node(m, at) for at, m in enumerate(self.messages)],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            chat_template_kwargs=self._template_kwargs(),
            sampling=self._sampling(),
        )


class GenerateRequest(_GenerateInput):
    prompt: str = ""  # empty: only load the model
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None  # deprecated in Ollama; only an empty one is accepted
    raw: bool = False
    images: list[str] | None = None
    uses_tools: ClassVar[bool] = False  # generate takes no tools

    @model_validator(mode="after")
    def _supported(self) -> "GenerateRequest":
        if self.suffix:
            raise ValueError("suffix: fill-in-the-middle is not supported")
        if self.template:
            raise ValueError(
                "template: Go templates are not run; send raw: true with the prompt already templated"
            )
        if self.context:
            raise ValueError("context: is not supported; send the conversation to /api/chat")
        if self.raw and (self.images or self.system):
            raise ValueError("raw: a raw prompt takes no images or system prompt")
        return self

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        if self.raw:
            return GenerationRequest(
                job=job,
                model=model,
                kind="completion",
                prompt=self.prompt,
                sampling=self._sampling(),
            )
        turns = [Message(role="system", content=self.system)] if self.system else []
        turns.append(Message(role="user", content=self.prompt, images=self.images))
        return GenerationRequest(
            job=job,
            model=model,
            kind="chat",
            messages=[_message_for_node(m, at) for at, m in enumerate(turns)],
            chat_template_kwargs=self._template_kwargs(),
            sampling=self._sampling(),
        )


class EmbedRequest(Lenient):
    """`/api/embed`: one text or several; inputs longer than the model's context are cut unless
    `truncate` is false (then they are refused)."""

    model: str = Field(min_length=1)
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    keep_alive: KeepAlive | None = None
    options: Options | None = None

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class EmbeddingRequest(Lenient):
    """`/api/embeddings`, the older endpoint: one `prompt`, one `embedding` back."""

    model: str = Field(min_length=1)
    prompt: str
    keep_alive: KeepAlive | None = None
    options: Options | None = None


class ShowRequest(Lenient):
    model: str = Field(min_length=1)
    name: str | None = None  # the older name of `model`, which ollama-js still sends (pull)
    verbose: bool = False

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


class DeleteRequest(ShowRequest):
    pass


class PullRequest(ShowRequest):
    insecure: bool = False
    stream: bool = True


# ---- responses --------------------------------------------------------------------------------


class Logprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list["Logprob"] | None = None


class Metrics(BaseModel):
    """The final object's counts and durations (nanoseconds)."""

    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class _Answer(Metrics):
    """What a chat and a generate object share; the metrics are set on the last (`done: true`)."""

    model: str
    created_at: datetime
    done: bool
    done_reason: str | None = None
    logprobs: list[Logprob] | None = None


class ChatResponse(_Answer):
    message: Message


class GenerateResponse(_Answer):
    response: str
    thinking: str | None = None


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingResponse(BaseModel):
    embedding: list[float]


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str = ""
    quantization_level: str = ""


class ListModelResponse(BaseModel):
    name: str
    model: str
    modified_at: datetime
    size: int
    digest: str
    details: ModelDetails


class ListResponse(BaseModel):
    models: list[ListModelResponse]


class ProcessModelResponse(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: datetime
    size_vram: int
    context_length: int
    nodes: list[str]  # Cortex's: the nodes holding it ready


class ProcessResponse(BaseModel):
    models: list[ProcessModelResponse]


Capability = Literal["completion", "tools", "insert", "vision", "embedding", "thinking"]


class ShowResponse(BaseModel):
    license: str = ""
    modelfile: str
    parameters: str
    template: str = ""
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[Capability]
    modified_at: datetime


class ProgressResponse(BaseModel):
    status: str
    digest: str | None = None  # what the line's bytes are of (Cortex: `{node}/{model folder}`)
    total: int | None = None
    completed: int | None = None


class VersionResponse(BaseModel):
    version: str


class ErrorResponse(BaseModel):
    error: str
