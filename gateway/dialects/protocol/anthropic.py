"""Anthropic Messages API wire types, named as Anthropic's spec names them, fields in spec order.

Requests validate Anthropic's types and ranges (a field this gateway does not know is ignored
and logged once: `gateway/dialects/protocol/lenient.py`) and convert themselves to the
same `shared.wire.GenerationRequest` an OpenAI chat request becomes: system blocks → a system
message, `tool_use` blocks → assistant `tool_calls`, `tool_result` blocks → `tool` messages,
tools → OpenAI-style function tools (what Hugging Face chat templates read).
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from gateway.dialects.protocol.bounds import CacheSalt, JsonSchema, MaxTokens, TopK
from gateway.dialects.protocol.lenient import Lenient
from gateway.dialects.tools.grammars import Constraint, ForcedCall, JsonOutput
from shared.wire import GenerationRequest, SamplingParams

# Anthropic documents no limit; every stop string is scanned for at each token, so keep it small.
STOP_SEQUENCES_MAX = 16


class CacheControlEphemeral(Lenient):
    type: Literal["ephemeral"]
    ttl: str | None = None


# ---- content blocks ------------------------------------------------------------------------


class TextBlockParam(Lenient):
    type: Literal["text"]
    text: str
    cache_control: CacheControlEphemeral | None = None
    citations: list[dict[str, Any]] | None = None


class Base64ImageSource(Lenient):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(Lenient):
    type: Literal["url"]
    url: str


class ImageBlockParam(Lenient):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControlEphemeral | None = None


class ToolUseBlockParam(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControlEphemeral | None = None
    caller: dict[str, Any] | None = None  # echoed back by SDKs from the response block; not used
    toolset_name: str | None = None


class ToolResultBlockParam(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: (
        str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] | None
    ) = None
    is_error: bool | None = None
    cache_control: CacheControlEphemeral | None = None


class ThinkingBlockParam(Lenient):
    """Accepted in history (Claude Code echoes them back) and not shown to the model."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlockParam(Lenient):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class SystemMessageParam(Lenient):
    """A system message among the turns (Claude Code sends its skill and agent listings so); it
    is folded into the system prompt, in order, since most open models' templates allow a system
    message only first. `clear_at: "next_user_message"` drops it once a later user turn exists."""

    role: Literal["system"]
    content: str | list[TextBlockParam]
    clear_at: Literal["next_user_message", "never"] | None = None


InputMessage = Annotated[MessageParam | SystemMessageParam, Field(discriminator="role")]


# ---- tools ------------------------------------------------------------------------------------


class Tool(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: JsonSchema
    type: Literal["custom"] | None = None
    cache_control: CacheControlEphemeral | None = None


class ToolChoiceAuto(Lenient):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Lenient):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Lenient):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Lenient):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class Metadata(Lenient):
    user_id: str | None = None


class ThinkingConfig(Lenient):
    """Accepted, not used: the served models do not think in Anthropic's protocol."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class ContextManagementEdit(Lenient):
    type: str  # clear_thinking_20251015, clear_tool_uses_20250919, compact_20260112 …
    keep: Any = None  # what the edit keeps ("all", or a count of turns)


class ContextManagementConfig(Lenient):
    """Accepted, not applied: Cortex never shows thinking blocks to the model and keeps the rest."""

    edits: list[ContextManagementEdit] | None = None


class JSONOutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(Lenient):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, not used
    format: JSONOutputFormat | None = None  # structured output: constrained decoding


# ---- requests ---------------------------------------------------------------------------------


def _text_of(blocks: list[TextBlockParam | ImageBlockParam] | str | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text if isinstance(b, TextBlockParam) else "" for b in blocks)


def _image_part(block: ImageBlockParam) -> dict[str, Any]:
    source = block.source
    url = (
        source.url
        if isinstance(source, URLImageSource)
        else f"data:{source.media_type};base64,{source.data}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _user_messages(content: list) -> list[dict[str, Any]]:
    """A user turn's blocks → `tool` messages (results first, as the calls were made), then the
    rest as one user message."""
    out, parts = [], []
    for block in content:
        if isinstance(block, ToolResultBlockParam):
            text = _text_of(block.content)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": f"Error: {text}" if block.is_error else text,
                }
            )
        elif isinstance(block, TextBlockParam):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlockParam):
            parts.append(_image_part(block))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(content: list) -> dict[str, Any]:
    text = "".join(b.text for b in content if isinstance(b, TextBlockParam))
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in content
        if isinstance(b, ToolUseBlockParam)
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _system_prompt(
    system: str | list[TextBlockParam] | None, messages: list[MessageParam | SystemMessageParam]
) -> str:
    """The top-level system prompt, then the system messages among the turns that still apply."""
    parts = [_text_of(system)]
    for at, message in enumerate(messages):
        if isinstance(message, SystemMessageParam):
            cleared = message.clear_at == "next_user_message" and any(
                m.role == "user" for m in messages[at + 1 :]
            )
            parts += [] if cleared else [_text_of(message.content)]
    return "\n\n".join(p for p in parts if p)


def messages_for_node(
    system: str | list[TextBlockParam] | None, messages: list[MessageParam | SystemMessageParam]
) -> list[dict[str, Any]]:
    prompt = _system_prompt(system, messages)
    out = [{"role": "system", "content": prompt}] if prompt else []
    for message in messages:
        if isinstance(message, SystemMessageParam):
            continue
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out += _user_messages(message.content)
        else:
            out.append(_assistant_message(message.content))
    return out


class _MessagesInput(Lenient):
    """What `/v1/messages` and `/v1/messages/count_tokens` share."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the older name of output_config.format
    context_management: ContextManagementConfig | None = None  # beta; Claude Code sends it
    # accepted, not used (Cortex has no prompt cache, containers, regions, speeds or workspaces)
    cache_control: CacheControlEphemeral | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _named_tool_exists(self):
        if isinstance(self.tool_choice, ToolChoiceTool) and self.tool_choice.name not in {
            t.name for t in self.tools or []
        }:
            raise ValueError(
                f"tool_choice: names tool '{self.tool_choice.name}', which is not in tools"
            )
        if (
            self.tool_choice is not None
            and not isinstance(self.tool_choice, ToolChoiceNone)
            and not self.tools
        ):
            raise ValueError("tool_choice: requires tools")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and not isinstance(self.tool_choice, ToolChoiceNone)

    def _node_tools(self) -> list[dict[str, Any]] | None:
        if not self.uses_tools:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools
        ]

    @property
    def constraint(self) -> Constraint:
        """A forced call (`any`, `tool`): one for `tool` or `disable_parallel_tool_use`, else a
        bounded number; or JSON output (`output_config.format`)."""
        choice = self.tool_choice
        if not self.uses_tools or not isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
            output = (
                self.output_config.format if self.output_config else None
            ) or self.output_format
            return JsonOutput(output.schema_, "output_config") if output else None
        tools = [{"name": t.name, "parameters": t.input_schema} for t in self.tools]
        named = choice.name if isinstance(choice, ToolChoiceTool) else None
        return ForcedCall.of(tools, named, parallel=not choice.disable_parallel_tool_use)


class MessageCreateParams(_MessagesInput):
    model: str
    max_tokens: MaxTokens
    messages: list[InputMessage] = Field(min_length=1)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, not used
    stop_sequences: Annotated[list[str], Field(max_length=STOP_SEQUENCES_MAX)] | None = None
    stream: bool = False
    system: str | list[TextBlockParam] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    thinking: ThinkingConfig | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    top_k: TopK | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    container: dict[str, Any] | str | None = None  # accepted, not used
    diagnostics: dict[str, Any] | None = None  # accepted, not used
    inference_geo: str | None = None  # accepted, not used
    speed: Literal["standard", "fast"] | None = None  # accepted, not used
    cache_salt: CacheSalt | None = (
        None  # vLLM's (an extension here): see gateway/dialects/protocol/bounds.py
    )

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        return GenerationRequest(
            job=job,
            model=model,
            kind="chat",
            messages=messages_for_node(self.system, self.messages),
            tools=self._node_tools(),
            sampling=SamplingParams(
                max_tokens=self.max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                stop=list(self.stop_sequences or []),
            ),
        )


class MessageCountTokensParams(_MessagesInput):
    stream: ClassVar[bool] = False  # never streamed (submit reads it)

    def to_generation_request(self, job: str, model: str) -> GenerationRequest:
        return GenerationRequest(
            job=job,
            model=model,
            kind="count",
            tools=self._node_tools(),
            messages=messages_for_node(self.system, self.messages),
        )


# ---- responses --------------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = 0
    cache_read_input_tokens: int | None = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class MessageTokensCount(BaseModel):
    input_tokens: int


# streaming events


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJSONDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    input_tokens: int | None = None
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
)


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
