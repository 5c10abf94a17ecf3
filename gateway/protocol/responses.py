"""OpenAI Responses API wire types (`/v1/responses`), named as the spec names them, fields in
spec order.

A request converts itself to the same `shared.wire.GenerationRequest` a chat request becomes:
`instructions` → a system message; input messages → chat messages (`developer` → system,
`input_text`/`output_text` parts → text, `input_image` → `image_url`); `function_call` items →
assistant `tool_calls`; `function_call_output` items → `tool` messages; a stored response's
conversation (`previous_response_id`) goes first. Hosted tools (web search, file search …) are
not served: a tool type other than `function` is a 400.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, Tag, model_validator

from gateway.protocol.bounds import JsonSchema, MaxTokens
from gateway.protocol.lenient import Lenient
from gateway.tools.grammars import Constraint, ForcedCall, JsonOutput
from shared.wire import GenerationRequest, SamplingParams

# ---- input items ----------------------------------------------------------------------------


class ResponseInputText(Lenient):
    type: Literal["input_text"]
    text: str


class ResponseInputImage(Lenient):
    type: Literal["input_image"]
    detail: Literal["low", "high", "auto"] = "auto"
    file_id: str | None = None
    image_url: str | None = None


class ResponseOutputTextParam(Lenient):
    type: Literal["output_text"]
    text: str


class ResponseOutputRefusalParam(Lenient):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[ResponseInputText | ResponseInputImage | ResponseOutputTextParam | ResponseOutputRefusalParam,
                        Field(discriminator="type")]


class EasyInputMessage(Lenient):
    """A message, whether sent by hand (`{"role", "content"}`) or echoed back from an output."""

    content: str | list[ContentPart]
    role: Literal["user", "assistant", "system", "developer"]
    type: Literal["message"] = "message"


class ResponseFunctionToolCallParam(Lenient):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"]


class FunctionCallOutput(Lenient):
    call_id: str
    output: str | list[ContentPart]
    type: Literal["function_call_output"]


class ResponseReasoningItemParam(Lenient):
    """Echoed back by agent clients; the served models see nothing of it."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


ResponseInputItem = Annotated[
    Annotated[EasyInputMessage, Tag("message")]
    | Annotated[ResponseFunctionToolCallParam, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponseReasoningItemParam, Tag("reasoning")],
    Discriminator(_item_type),
]


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(p, "text", None) or getattr(p, "refusal", "") for p in content)


def _parts(content: str | list) -> str | list[dict[str, Any]]:
    """Message content as chat content: text, or parts with images as `image_url`."""
    if isinstance(content, str) or not any(isinstance(p, ResponseInputImage) for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url or ""}} if isinstance(p, ResponseInputImage)
            else {"type": "text", "text": _text([p])} for p in content]


def messages_for_node(items: list) -> list[dict[str, Any]]:
    """Input items → chat messages; consecutive calls join the assistant message before them."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, EasyInputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _parts(item.content)})
        elif isinstance(item, ResponseFunctionToolCallParam):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


# ---- tools and text format ---------------------------------------------------------------------


class FunctionTool(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    parameters: JsonSchema | None = None
    strict: bool | None = None
    type: Literal["function"]
    description: str | None = None


class ToolChoiceFunction(Lenient):
    name: str
    type: Literal["function"]


class ResponseFormatText(Lenient):
    type: Literal["text"]


class ResponseFormatJSONObject(Lenient):
    type: Literal["json_object"]


class ResponseFormatTextJSONSchemaConfig(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: JsonSchema = Field(alias="schema")
    type: Literal["json_schema"]
    description: str | None = None
    strict: bool | None = None


class ResponseTextConfig(Lenient):
    format: Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatTextJSONSchemaConfig,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class Reasoning(Lenient):
    """Accepted, not used: the served models do not reason in this protocol."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request ----------------------------------------------------------------------------------


class ResponseCreateParams(Lenient):
    background: bool | None = None
    include: list[str] | None = None  # accepted, not used
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    model: str
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None  # accepted, not used
    reasoning: Reasoning | None = None
    safety_identifier: str | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used
    store: bool | None = True
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    text: ResponseTextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    tools: list[FunctionTool] | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    truncation: Literal["auto", "disabled"] | None = None  # accepted; a prompt too long is a 400 either way
    user: str | None = None  # accepted, not used
    _history: list[dict[str, Any]] = PrivateAttr(default_factory=list)  # the previous response's conversation

    @model_validator(mode="after")
    def _supported(self) -> "ResponseCreateParams":
        if self.background:
            raise ValueError("background: is not supported; stream the response instead")
        named = self.tool_choice.name if isinstance(self.tool_choice, ToolChoiceFunction) else None
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: requires tools")
        if named is not None and named not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice: names function '{named}', which is not in tools")
        return self

    def continue_from(self, history: list[dict[str, Any]]) -> None:
        """Put the conversation of `previous_response_id` before this request's input."""
        self._history = history

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The turns so far, this request's input last (what a stored response keeps)."""
        new = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else messages_for_node(self.input)
        return [*self._history, *new]

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constraint(self) -> Constraint:
        """A forced call (`required`, a named function) or JSON output (`text.format`)."""
        if self.uses_tools and self.tool_choice not in (None, "auto"):
            named = self.tool_choice.name if isinstance(self.tool_choice, ToolChoiceFunction) else None
            tools = [{"name": t.name, "parameters": t.parameters} for t in self.tools]
            return ForcedCall.of(tools, named, parallel=self.parallel_tool_calls is not False)
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return JsonOutput(fmt.schema_ if isinstance(fmt, ResponseFormatTextJSONSchemaConfig) else None, "text.format")

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                 for t in self.tools] if self.uses_tools else None
        return GenerationRequest(
            job=job, model=model, kind="chat", messages=system + self.conversation, tools=tools,
            sampling=SamplingParams(
                max_tokens=self.max_output_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
            ),
        )


# ---- the response ---------------------------------------------------------------------------------


class ResponseOutputText(BaseModel):
    annotations: list[Any] = []
    text: str
    type: Literal["output_text"] = "output_text"
    logprobs: list[Any] = []


class ResponseOutputMessage(BaseModel):
    id: str
    content: list[ResponseOutputText]
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    type: Literal["message"] = "message"


class ResponseFunctionToolCall(BaseModel):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"] = "function_call"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = ResponseOutputMessage | ResponseFunctionToolCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Response(BaseModel):
    id: str
    created_at: int
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    metadata: dict[str, str] | None
    model: str
    object: Literal["response"] = "response"
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    temperature: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    store: bool
    text: dict[str, Any]
    truncation: str
    usage: ResponseUsage | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# ---- stream events (each carries its `sequence_number`, set as it is sent) ----------------------


class _Event(BaseModel):
    sequence_number: int = 0


class ResponseCreatedEvent(_Event):
    type: Literal["response.created"] = "response.created"
    response: Response


class ResponseInProgressEvent(_Event):
    type: Literal["response.in_progress"] = "response.in_progress"
    response: Response


class ResponseOutputItemAddedEvent(_Event):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    output_index: int
    item: ResponseOutputItem


class ResponseContentPartAddedEvent(_Event):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    item_id: str
    output_index: int
    content_index: int = 0
    part: ResponseOutputText


class ResponseTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class ResponseTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ResponseContentPartDoneEvent(_Event):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    item_id: str
    output_index: int
    content_index: int = 0
    part: ResponseOutputText


class ResponseFunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseOutputItemDoneEvent(_Event):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    output_index: int
    item: ResponseOutputItem


class ResponseCompletedEvent(_Event):
    type: Literal["response.completed"] = "response.completed"
    response: Response


class ResponseIncompleteEvent(_Event):
    type: Literal["response.incomplete"] = "response.incomplete"
    response: Response


class ResponseErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None


ResponseStreamEvent = (ResponseCreatedEvent | ResponseInProgressEvent | ResponseOutputItemAddedEvent
                       | ResponseContentPartAddedEvent | ResponseTextDeltaEvent | ResponseTextDoneEvent
                       | ResponseContentPartDoneEvent | ResponseFunctionCallArgumentsDeltaEvent
                       | ResponseFunctionCallArgumentsDoneEvent | ResponseOutputItemDoneEvent | ResponseCompletedEvent
                       | ResponseIncompleteEvent | ResponseErrorEvent)
