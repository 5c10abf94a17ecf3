"""OpenAI wire types, named as the OpenAI spec names them, fields in spec order.

Requests validate OpenAI's types and ranges so bad input never reaches a node (a field this
gateway does not know is ignored and logged once: `gateway/dialects/protocol/lenient.py`); each request
converts itself to the `shared.wire.GenerationRequest` a node runs.
Extensions beyond OpenAI (vLLM's names: `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `chat_template_kwargs`; Cortex's `speculative` and
`num_speculative_tokens`, overriding the model's catalogue entry) come after the spec's fields.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from gateway.dialects.protocol.bounds import (
    LOGIT_BIAS_MAX,
    TOKEN_ID_MAX,
    CacheSalt,
    ChatTemplateKwargs,
    Int64,
    JsonSchema,
    KeepAlive,
    MaxTokens,
    Speculative,
    SpeculativeTokens,
    StopTokenIds,
    TokenId,
    TopK,
    duration_s,
)
from gateway.dialects.protocol.lenient import Lenient
from gateway.dialects.tools.grammars import Constraint, ForcedCall, JsonOutput
from shared.wire import GenerationRequest, SamplingParams

Stop = str | Annotated[list[str], Field(max_length=4)]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=LOGIT_BIAS_MAX)
]


# ---- messages ---------------------------------------------------------------------------


class ChatCompletionRequestMessageContentPartText(Lenient):
    type: Literal["text"]
    text: str


class ImageURL(Lenient):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ChatCompletionRequestMessageContentPartImage(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Lenient):
    data: str
    format: Literal["wav", "mp3"]


class ChatCompletionRequestMessageContentPartAudio(Lenient):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ChatCompletionRequestMessageContentPartRefusal(Lenient):
    type: Literal["refusal"]
    refusal: str


TextPart = ChatCompletionRequestMessageContentPartText
UserPart = Annotated[
    TextPart
    | ChatCompletionRequestMessageContentPartImage
    | ChatCompletionRequestMessageContentPartAudio,
    Field(discriminator="type"),
]
AssistantPart = Annotated[
    TextPart | ChatCompletionRequestMessageContentPartRefusal, Field(discriminator="type")
]


class FunctionCall(Lenient):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionRequestSystemMessage(Lenient):
    content: str | list[TextPart]
    role: Literal["system"]
    name: str | None = None


class ChatCompletionRequestDeveloperMessage(Lenient):
    content: str | list[TextPart]
    role: Literal["developer"]
    name: str | None = None


class ChatCompletionRequestUserMessage(Lenient):
    content: str | list[UserPart]
    role: Literal["user"]
    name: str | None = None


class ChatCompletionRequestAssistantMessage(Lenient):
    content: str | list[AssistantPart] | None = None
    refusal: str | None = None
    role: Literal["assistant"]
    name: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None


class ChatCompletionRequestToolMessage(Lenient):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


ChatCompletionRequestMessage = Annotated[
    ChatCompletionRequestSystemMessage
    | ChatCompletionRequestDeveloperMessage
    | ChatCompletionRequestUserMessage
    | ChatCompletionRequestAssistantMessage
    | ChatCompletionRequestToolMessage,
    Field(discriminator="role"),
]


def _message_for_node(message: BaseModel) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if data["role"] == "developer":  # open models' chat templates know "system", not "developer"
        data["role"] = "system"
    return data


# ---- tools ------------------------------------------------------------------------------


class FunctionObject(Lenient):
    description: str | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ChatCompletionTool(Lenient):
    type: Literal["function"]
    function: FunctionObject


class ChatCompletionStreamOptions(Lenient):
    include_usage: bool = False


class ChatCompletionNamedToolChoiceFunction(Lenient):
    name: str


class ChatCompletionNamedToolChoice(Lenient):
    type: Literal["function"]
    function: ChatCompletionNamedToolChoiceFunction


class JSONSchema(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


# ---- requests ---------------------------------------------------------------------------


class _Sampling(Lenient):
    """Sampling fields shared by both request kinds, and their conversion."""

    @property
    def keep_alive_s(self) -> float | None:
        return duration_s(self.keep_alive)

    def _sampling(self, **overrides: Any) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            **overrides,
        )

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _token_ids(cls, bias: LogitBias | None) -> LogitBias | None:
        if bias and not all(
            key.isascii() and key.isdigit() and int(key) <= TOKEN_ID_MAX for key in bias
        ):
            raise ValueError("keys must be token ids (non-negative integers as strings)")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: is only allowed when stream is true")
        return self


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatCompletionRequestMessage] = Field(min_length=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None  # accepted, not used
    n: int = Field(1, ge=1, le=128)
    parallel_tool_calls: bool | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    prompt_cache_key: str | None = (
        None  # routes the conversation to the node that ran it (gateway/fleet/routing.py)
    )
    response_format: ResponseFormat | None = None
    seed: Int64 | None = None
    service_tier: str | None = None  # accepted, not used
    stop: Stop | None = None
    store: bool | None = None  # accepted, not used
    stream: bool = False
    stream_options: ChatCompletionStreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoice | None = None
    user: str | None = None  # a session for routing when there is no prompt_cache_key
    # extensions
    cache_salt: CacheSalt | None = None  # vLLM's: see gateway/dialects/protocol/bounds.py
    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    stop_token_ids: StopTokenIds = []
    chat_template_kwargs: ChatTemplateKwargs = {}
    add_generation_prompt: bool = True
    ignore_eos: bool = False
    keep_alive: KeepAlive = (
        None  # Ollama's: seconds or "5m"/"1h"; keep the model loaded this long after
    )
    priority: Int64 = (
        0  # within its class: lower is served sooner (vLLM's convention); see shared/queues.py
    )
    speculative: Speculative = None
    num_speculative_tokens: SpeculativeTokens = None

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: requires tools")
        named = (
            self.tool_choice.function.name
            if isinstance(self.tool_choice, ChatCompletionNamedToolChoice)
            else None
        )
        if named is not None and named not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: names function '{named}', which is not in tools")
        if (
            self.response_format
            and self.response_format.type == "json_schema"
            and not self.response_format.json_schema
        ):
            raise ValueError("response_format: json_schema requires a json_schema object")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constraint(self) -> Constraint:
        """A forced call (`required`, named) or JSON output (`response_format`)."""
        if self.uses_tools and self.tool_choice not in (None, "auto"):
            named = (
                self.tool_choice.function.name
                if isinstance(self.tool_choice, ChatCompletionNamedToolChoice)
                else None
            )
            tools = [
                {"name": t.function.name, "parameters": t.function.parameters} for t in self.tools
            ]
            return ForcedCall.of(tools, named, parallel=self.parallel_tool_calls is not False)
        if self.response_format is None or self.response_format.type == "text":
            return None
        schema = (
            self.response_format.json_schema.schema_ if self.response_format.json_schema else None
        )
        return JsonOutput(schema or None, "response_format")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        use_tools = self.uses_tools
        return GenerationRequest(
            job=job,
            model=model,
            kind="chat",
            messages=[_message_for_node(m) for m in self.messages],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if use_tools else None,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt,
            sampling=self._sampling(
                max_tokens=self.max_completion_tokens or self.max_tokens,
                logprobs=self.logprobs,
                top_logprobs=self.top_logprobs or 0,
            ),
        )


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool = False
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    max_tokens: MaxTokens | None = 16
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: ChatCompletionStreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None
    # extensions
    cache_salt: CacheSalt | None = None  # vLLM's: see gateway/dialects/protocol/bounds.py
    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    keep_alive: KeepAlive = (
        None  # Ollama's: seconds or "5m"/"1h"; keep the model loaded this long after
    )
    priority: Int64 = (
        0  # within its class: lower is served sooner (vLLM's convention); see shared/queues.py
    )
    speculative: Speculative = None
    num_speculative_tokens: SpeculativeTokens = None
    uses_tools: ClassVar[bool] = False  # completions take no tools
    constraint: ClassVar[Constraint] = None  # and no grammar

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(
                    "batches of prompts are not supported; send one prompt per request"
                )
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must not be empty")
        return prompt

    @model_validator(mode="after")
    def _supported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix: is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n is supported")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        return GenerationRequest(
            job=job,
            model=model,
            kind="completion",
            prompt=self.prompt,
            echo=self.echo,
            sampling=self._sampling(
                max_tokens=self.max_tokens,
                logprobs=self.logprobs is not None,
                top_logprobs=self.logprobs or 0,
                prompt_logprobs=self.logprobs if self.echo else None,
            ),
        )


# ---- responses --------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class ChatCompletionTokenLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatCompletionTokenLogprobTop]


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(BaseModel):
    content: str | None
    refusal: str | None = None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ChatCompletionMessageToolCall] | None = None

    @model_serializer(mode="wrap")
    def _tool_calls_when_made(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(BaseModel):
    finish_reason: str | None
    index: int
    logprobs: ChoiceLogprobs | None = None
    message: ChatCompletionMessage


class ChatCompletion(BaseModel):
    id: str
    choices: list[ChatCompletionChoice]
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage


class SetFieldsOnly(BaseModel):
    """Only the fields that are set (not None) appear on the wire."""

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChoiceDeltaToolCallFunction(SetFieldsOnly):
    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(SetFieldsOnly):
    """The first piece of a call carries `id`, `type` and the name; later ones more `arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChoiceDeltaToolCallFunction


class ChatCompletionStreamResponseDelta(SetFieldsOnly):
    """Only the fields that are set appear on the wire: `{"content": "Hi"}`, or `{}` at the end."""

    content: str | None = None
    refusal: str | None = None
    role: Literal["assistant"] | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChatCompletionChunkChoice(BaseModel):
    delta: ChatCompletionStreamResponseDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    index: int


class ChatCompletionChunk(BaseModel):
    id: str
    choices: list[ChatCompletionChunkChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape (with `echo`, the prompt's first token has no logprob: None)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    finish_reason: str | None
    index: int
    logprobs: CompletionLogprobs | None = None
    text: str


class Completion(BaseModel):
    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class CompletionChunk(Completion):
    """A streamed completion piece: the same `text_completion` object as the final one."""


class ModelReplica(BaseModel):
    """Cortex's extension: one live node holding the model."""

    node: str
    state: str
    slots_used: int
    slots_total: int
    download_fraction: float | None = None  # while `downloading`: the share of its files here, 0..1
    quant: str | None = (
        None  # how its Linear weights run ("int4", "int8", "fp8", "int4+int8", "none"); None until loaded
    )
    weight_mb: int | None = None  # what its weights hold on its device; None until loaded
    kernels: str | None = None  # which kernels its matmuls and decode step run; None until loaded


class Model(BaseModel):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "cortex"
    # extensions: catalogue models are listed even when not loaded (a request loads them)
    state: str = (
        "not_loaded"  # the best state among its replicas: ready, loading, poisoned, failed …
    )
    replicas: list[ModelReplica] = []
    root: str  # vLLM's name: the model an id names (an alias's model, or the model itself)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model
    capabilities: list[Literal["vision"]] = []  # "vision": it reads images in messages
    kind: Literal["generate", "embedding", "rerank"] = (
        "generate"  # what it serves (the catalogue's `kind`)
    )
    max_model_len: int | None = (
        None  # vLLM's: the longest sequence its replicas run; None until one is loaded
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Error(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error
