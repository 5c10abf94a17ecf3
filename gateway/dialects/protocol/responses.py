"""OpenAI Responses API wire types (`/v1/responses`), named as the spec names them, fields in
spec order.

A request converts itself to the same `shared.wire.GenerationRequest` a chat request becomes:
`instructions` → a system message; input items → chat messages (gateway/dialects/protocol/responses_input.py);
a stored response's conversation (`previous_response_id`) goes first; the functions its tools offer
(gateway/dialects/protocol/responses_tools.py: `function` tools and namespaces' functions; hosted and
built-in tools are left out, and the response says so) → chat tools.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from gateway.dialects.protocol.bounds import CacheSalt, JsonSchema, MaxTokens
from gateway.dialects.protocol.lenient import Lenient
from gateway.dialects.protocol.responses_input import (
    AdditionalTools,
    ResponseInput,
    messages_for_node,
)
from gateway.dialects.protocol.responses_tools import (
    Function,
    Offer,
    Tool,
    ToolChoice,
    ToolChoiceAllowed,
    ToolChoiceFunction,
    ToolChoiceUnservable,
    offered_name,
)
from gateway.dialects.tools.grammars import Constraint, ForcedCall, JsonOutput
from shared.wire import GenerationRequest, SamplingParams

# ---- text format and reasoning -------------------------------------------------------------------


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
    format: (
        Annotated[
            ResponseFormatText | ResponseFormatJSONObject | ResponseFormatTextJSONSchemaConfig,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class Reasoning(Lenient):
    """Accepted, not used: the served models do not reason in this protocol."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request ----------------------------------------------------------------------------------


class ResponseCreateParams(Lenient):
    background: bool | None = None
    client_metadata: dict[str, Any] | None = (
        None  # accepted, not used (the Codex CLI sends its session's ids)
    )
    include: list[str] | None = None  # accepted, not used
    input: ResponseInput
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    model: str
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = (
        None  # routes the conversation to the node that ran it (gateway/fleet/routing.py)
    )
    reasoning: Reasoning | None = None
    safety_identifier: str | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used
    store: bool | None = True
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    text: ResponseTextConfig | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    truncation: Literal["auto", "disabled"] | None = (
        None  # accepted; a prompt too long is a 400 either way
    )
    user: str | None = None  # a session for routing when there is no prompt_cache_key
    cache_salt: CacheSalt | None = (
        None  # vLLM's (an extension): see gateway/dialects/protocol/bounds.py
    )
    _history: list[dict[str, Any]] = PrivateAttr(
        default_factory=list
    )  # the previous response's conversation
    _offer: Offer = PrivateAttr(default_factory=Offer)

    @model_validator(mode="after")
    def _supported(self) -> "ResponseCreateParams":
        if self.background and self.store is False:
            raise ValueError(
                "background: requires store (a background response is kept to be fetched later)"
            )
        self._offer.add("tools", self.tools or [])
        for i, item in enumerate(self.input):
            if isinstance(item, AdditionalTools):
                self._offer.add(f"input[{i}].tools", item.tools)
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceUnservable):
            raise ValueError(
                f"tool_choice: forces a {choice.type} tool, which does not run here "
                f"(Cortex offers models function tools only)"
            )
        if choice not in (None, "none") and not self._offer.functions:
            raise ValueError("tool_choice: requires function tools")
        for name in self._chosen or []:
            if name not in self._offer.functions:
                raise ValueError(f"tool_choice: names function '{name}', which is not in tools")
        return self

    @property
    def _chosen(self) -> list[str] | None:
        """The functions `tool_choice` names (`namespace.function` for a namespace's); None: any."""
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            return [choice.name]
        if isinstance(choice, ToolChoiceAllowed):
            return [
                offered_name(t.get("namespace"), str(t.get("name")))
                for t in choice.tools
                if t.get("type") == "function"
            ]
        return None

    def continue_from(self, history: list[dict[str, Any]]) -> None:
        """Put the conversation of `previous_response_id` before this request's input."""
        self._history = history

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The turns so far, this request's input last (what a stored response keeps)."""
        return [*self._history, *messages_for_node(self.input)]

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """This request's input items as sent (what `GET /v1/responses/{id}/input_items` lists)."""
        return [
            item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in self.input
        ]

    @property
    def offer(self) -> Offer:
        """What the request's tools offer the model, and what they leave out."""
        return self._offer

    @property
    def functions(self) -> list[Function]:
        """The functions the model is offered: those `tool_choice` allows (all, unless `allowed_tools`)."""
        allowed = self._chosen if isinstance(self.tool_choice, ToolChoiceAllowed) else None
        return [
            f for name, f in self._offer.functions.items() if allowed is None or name in allowed
        ]

    @property
    def uses_tools(self) -> bool:
        return bool(self.functions) and self.tool_choice != "none"

    @property
    def constraint(self) -> Constraint:
        """A forced call (`required`, a named function, allowed tools `required`) or JSON output (`text.format`)."""
        choice = self.tool_choice
        if self.uses_tools and (
            choice == "required"
            or isinstance(choice, ToolChoiceFunction)
            or isinstance(choice, ToolChoiceAllowed)
            and choice.mode == "required"
        ):
            named = choice.name if isinstance(choice, ToolChoiceFunction) else None
            tools = [{"name": f.name, "parameters": f.tool.parameters} for f in self.functions]
            return ForcedCall.of(tools, named, parallel=self.parallel_tool_calls is not False)
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return JsonOutput(
            fmt.schema_ if isinstance(fmt, ResponseFormatTextJSONSchemaConfig) else None,
            "text.format",
        )

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [f.for_node() for f in self.functions] if self.uses_tools else None
        return GenerationRequest(
            job=job,
            model=model,
            kind="chat",
            messages=system + self.conversation,
            tools=tools,
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
    namespace: str | None = None  # a namespace tool's function: `name` is the function's own name
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
    background: bool = False
    max_output_tokens: int | None
    previous_response_id: str | None
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    store: bool
    text: dict[str, Any]
    truncation: str
    usage: ResponseUsage | None = None


class ResponseItemList(BaseModel):
    """A page of a stored response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def page(cls, items: list[dict[str, Any]], limit: int, after: str | None) -> "ResponseItemList":
        """Up to `limit` of `items` (in the order asked for), from the one after `after`."""
        rest = items
        if after is not None:
            ids = [item["id"] for item in items]
            rest = items[ids.index(after) + 1 :] if after in ids else []
        data = rest[:limit]
        return cls(
            data=data,
            first_id=data[0]["id"] if data else None,
            last_id=data[-1]["id"] if data else None,
            has_more=len(rest) > limit,
        )


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
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
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


ResponseStreamEvent = (
    ResponseCreatedEvent
    | ResponseInProgressEvent
    | ResponseOutputItemAddedEvent
    | ResponseContentPartAddedEvent
    | ResponseTextDeltaEvent
    | ResponseTextDoneEvent
    | ResponseContentPartDoneEvent
    | ResponseFunctionCallArgumentsDeltaEvent
    | ResponseFunctionCallArgumentsDoneEvent
    | ResponseOutputItemDoneEvent
    | ResponseCompletedEvent
    | ResponseIncompleteEvent
    | ResponseErrorEvent
)
