"""Responses API input items: every item type of the spec with its fields (ids, statuses, callers),
named as the spec names them, and what the model is shown of them (`messages_for_node`).

Shown to the model, as chat messages: `message` items (`developer` → system; `input_text` /
`output_text` / `refusal` parts → text, `input_image` → `image_url`); `function_call` and
`custom_tool_call` items → assistant `tool_calls` (a custom call's input as `{"input": …}`);
`function_call_output` and `custom_tool_call_output` items → `tool` messages. Refused with a 400:
`item_reference` (items are not kept by id here: send the item itself, or
`previous_response_id`), `compaction_trigger` (nothing compacts here) and `input_file` parts.
Accepted and not shown (logged at debug): reasoning, compaction, and the records of tools the
model is never offered (web search, file search, computer, image generation, code interpreter,
shells, apply_patch, MCP, tool search, programs); `additional_tools` items add their tools to
the request's `tools`.
"""

import json
import logging
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from gateway.dialects.protocol.lenient import Lenient
from gateway.dialects.protocol.responses_tools import Tool, offered_name

log = logging.getLogger(__name__)

Status = Literal["in_progress", "completed", "incomplete"]
CallStatus = Literal[
    "in_progress", "searching", "completed", "incomplete", "failed"
]  # hosted searches


class Caller(Lenient):
    """Who made a tool call: the model (`direct`) or a program it ran (`program`)."""

    type: Literal["direct", "program"]
    caller_id: str | None = None


# ---- content parts ---------------------------------------------------------------------------------


class ResponseInputText(Lenient):
    text: str
    type: Literal["input_text"]
    prompt_cache_breakpoint: dict[str, Any] | None = (
        None  # accepted, not used (no explicit prompt cache)
    )


class ResponseInputImage(Lenient):
    detail: Literal["low", "high", "auto", "original"] = "auto"
    type: Literal["input_image"]
    file_id: str | None = None
    image_url: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class ResponseInputFile(Lenient):
    type: Literal["input_file"]
    detail: Literal["low", "high", "auto"] | None = None
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unservable(self) -> "ResponseInputFile":
        raise ValueError(
            "files are not read here; send their text as input_text (or images as input_image)"
        )


class ResponseOutputTextParam(Lenient):
    annotations: list[Any] = []
    text: str
    type: Literal["output_text"]
    logprobs: list[Any] | None = None


class ResponseOutputRefusalParam(Lenient):
    refusal: str
    type: Literal["refusal"]


ContentPart = Annotated[
    ResponseInputText
    | ResponseInputImage
    | ResponseInputFile
    | ResponseOutputTextParam
    | ResponseOutputRefusalParam,
    Field(discriminator="type"),
]


def _text_as_part(value: Any) -> Any:
    """Content given as a string is one `input_text` part, which the spec says it is equivalent to
    (one shape, so a bad part's 400 names its place plainly: `input.0.content.1`)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


Content = Annotated[list[ContentPart], BeforeValidator(_text_as_part)]

# ---- items shown to the model -------------------------------------------------------------------------


class EasyInputMessage(Lenient):
    """A message, whether sent by hand (`{"role", "content"}`), as an input message (`status`) or
    echoed back from an output (`id`, `status`, `phase`)."""

    content: Content
    role: Literal["user", "assistant", "system", "developer"]
    type: Literal["message"] = "message"
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # accepted, not used


class ResponseFunctionToolCallParam(Lenient):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"]
    id: str | None = None
    async_: bool | None = Field(None, alias="async")
    caller: Caller | None = None
    namespace: str | None = None
    status: Status | None = None


class FunctionCallOutput(Lenient):
    output: Content
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str | None = None
    caller: Caller | None = None
    name: str | None = None
    namespace: str | None = None
    status: Status | None = None


class ResponseCustomToolCallParam(Lenient):
    call_id: str
    input: str
    name: str
    type: Literal["custom_tool_call"]
    id: str | None = None
    async_: bool | None = Field(None, alias="async")
    caller: Caller | None = None
    namespace: str | None = None


class ResponseCustomToolCallOutputParam(Lenient):
    call_id: str
    output: Content
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    caller: Caller | None = None


class AdditionalTools(Lenient):
    """Tools made available from this point on: they join the request's `tools`."""

    role: Literal["developer"]
    tools: list[Tool]
    type: Literal["additional_tools"]
    id: str | None = None


# ---- items refused -----------------------------------------------------------------------------------


class ItemReference(Lenient):
    id: str
    type: Literal["item_reference"] | None = "item_reference"

    @model_validator(mode="after")
    def _unservable(self) -> "ItemReference":
        raise ValueError(
            "items are not kept by id here; send the item itself, or continue with previous_response_id"
        )


class CompactionTrigger(Lenient):
    type: Literal["compaction_trigger"]
    id: str | None = None

    @model_validator(mode="after")
    def _unservable(self) -> "CompactionTrigger":
        raise ValueError("nothing compacts a conversation here")


# ---- items accepted and not shown (the model is never offered the tools that made them) ---------------


class ResponseReasoningItemParam(Lenient):
    id: str | None = None
    summary: list[dict[str, Any]] = []
    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class ResponseCompactionItemParam(Lenient):
    encrypted_content: str
    type: Literal["compaction"]
    id: str | None = None


class ResponseFileSearchToolCallParam(Lenient):
    id: str
    queries: list[str] = []
    status: CallStatus
    type: Literal["file_search_call"]
    results: list[dict[str, Any]] | None = None


class ResponseComputerToolCallParam(Lenient):
    id: str
    call_id: str
    pending_safety_checks: list[dict[str, Any]] = []
    status: Status
    type: Literal["computer_call"]
    action: dict[str, Any] | None = None
    actions: list[dict[str, Any]] | None = None


class ComputerCallOutput(Lenient):
    call_id: str
    output: dict[str, Any]
    type: Literal["computer_call_output"]
    id: str | None = None
    acknowledged_safety_checks: list[dict[str, Any]] | None = None
    status: Status | None = None


class ResponseFunctionWebSearchParam(Lenient):
    id: str
    action: dict[str, Any] | None = None
    status: CallStatus
    type: Literal["web_search_call"]


class ToolSearchCall(Lenient):
    arguments: Any
    type: Literal["tool_search_call"]
    id: str | None = None
    call_id: str | None = None
    execution: Literal["server", "client"] | None = None
    status: Status | None = None


class ResponseToolSearchOutputItemParam(Lenient):
    tools: list[dict[str, Any]]
    type: Literal["tool_search_output"]
    id: str | None = None
    call_id: str | None = None
    execution: Literal["server", "client"] | None = None
    status: Status | None = None


class ResponseConfigurationUpdateItemParam(Lenient):
    type: Literal["configuration_update"]
    id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None


class ImageGenerationCall(Lenient):
    id: str
    result: str | None = None
    status: Literal["in_progress", "completed", "generating", "failed"]
    type: Literal["image_generation_call"]
    action: str | None = None
    background: str | None = None
    error: dict[str, Any] | None = None
    output_format: str | None = None
    quality: str | None = None
    revised_prompt: str | None = None
    size: str | None = None
    svg_usage: dict[str, Any] | None = None


class ResponseCodeInterpreterToolCallParam(Lenient):
    id: str
    code: str | None = None
    container_id: str
    outputs: list[dict[str, Any]] | None = None
    status: Literal["in_progress", "completed", "incomplete", "interpreting", "failed"]
    type: Literal["code_interpreter_call"]


class LocalShellCall(Lenient):
    id: str
    action: dict[str, Any]
    call_id: str
    status: Status
    type: Literal["local_shell_call"]


class LocalShellCallOutput(Lenient):
    id: str
    output: str
    type: Literal["local_shell_call_output"]
    status: Status | None = None


class ShellCall(Lenient):
    action: dict[str, Any]
    call_id: str
    type: Literal["shell_call"]
    id: str | None = None
    caller: Caller | None = None
    environment: dict[str, Any] | None = None
    status: Status | None = None


class ShellCallOutput(Lenient):
    call_id: str
    output: list[dict[str, Any]]
    type: Literal["shell_call_output"]
    id: str | None = None
    caller: Caller | None = None
    max_output_length: int | None = None
    status: Status | None = None


class ApplyPatchCall(Lenient):
    call_id: str
    operation: dict[str, Any]
    status: Literal["in_progress", "completed"]
    type: Literal["apply_patch_call"]
    id: str | None = None
    caller: Caller | None = None


class ApplyPatchCallOutput(Lenient):
    call_id: str
    status: Literal["completed", "failed"]
    type: Literal["apply_patch_call_output"]
    id: str | None = None
    caller: Caller | None = None
    output: str | None = None


class McpListTools(Lenient):
    id: str
    server_label: str
    tools: list[dict[str, Any]]
    type: Literal["mcp_list_tools"]
    error: str | None = None


class McpApprovalRequest(Lenient):
    id: str
    arguments: str
    name: str
    server_label: str
    type: Literal["mcp_approval_request"]


class McpApprovalResponse(Lenient):
    approval_request_id: str
    approve: bool
    type: Literal["mcp_approval_response"]
    id: str | None = None
    reason: str | None = None


class McpCall(Lenient):
    id: str
    arguments: str
    name: str
    server_label: str
    type: Literal["mcp_call"]
    approval_request_id: str | None = None
    error: Any = None
    output: str | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] | None = None


class Program(Lenient):
    id: str
    call_id: str
    code: str
    fingerprint: str
    type: Literal["program"]


class ProgramOutput(Lenient):
    id: str
    call_id: str
    result: str
    status: Literal["completed", "incomplete"]
    type: Literal["program_output"]


_ITEMS = [
    EasyInputMessage,
    ResponseFileSearchToolCallParam,
    ResponseComputerToolCallParam,
    ComputerCallOutput,
    ResponseFunctionWebSearchParam,
    ResponseFunctionToolCallParam,
    FunctionCallOutput,
    ToolSearchCall,
    ResponseToolSearchOutputItemParam,
    AdditionalTools,
    ResponseConfigurationUpdateItemParam,
    ResponseReasoningItemParam,
    ResponseCompactionItemParam,
    ImageGenerationCall,
    ResponseCodeInterpreterToolCallParam,
    LocalShellCall,
    LocalShellCallOutput,
    ShellCall,
    ShellCallOutput,
    ApplyPatchCall,
    ApplyPatchCallOutput,
    McpListTools,
    McpApprovalRequest,
    McpApprovalResponse,
    McpCall,
    ResponseCustomToolCallOutputParam,
    ResponseCustomToolCallParam,
    CompactionTrigger,
    ItemReference,
    Program,
    ProgramOutput,
]


def _tag(item: type[Lenient]) -> str:
    kind = item.model_fields["type"]
    return get_args(kind.annotation)[0] if kind.is_required() else kind.default


def _item_type(value: Any) -> str:
    """An item's `type`; without one, a message (`{"role", "content"}`) or an item reference (`{"id"}`)."""
    given = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if given:
        return given
    return (
        "item_reference"
        if isinstance(value, dict) and "id" in value and "role" not in value
        else "message"
    )


ResponseInputItem = Annotated[
    Union[tuple(Annotated[item, Tag(_tag(item))] for item in _ITEMS)],  # noqa: UP007
    Discriminator(_item_type),
]


def _text_as_message(value: Any) -> Any:
    """`input` given as a string is one user message, which the spec says it is equivalent to."""
    if not isinstance(value, str | list):
        raise ValueError("must be text or a list of input items")
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


ResponseInput = Annotated[list[ResponseInputItem], BeforeValidator(_text_as_message)]

# ---- what the model is shown -------------------------------------------------------------------------


def _text(content: list) -> str:
    return "".join(getattr(p, "text", None) or getattr(p, "refusal", "") for p in content)


def _parts(content: list) -> str | list[dict[str, Any]]:
    """Message content as chat content: text, or parts with images as `image_url`."""
    if not any(isinstance(p, ResponseInputImage) for p in content):
        return _text(content)
    return [
        {"type": "image_url", "image_url": {"url": p.image_url or ""}}
        if isinstance(p, ResponseInputImage)
        else {"type": "text", "text": _text([p])}
        for p in content
    ]


def _call(item: ResponseFunctionToolCallParam | ResponseCustomToolCallParam) -> dict[str, Any]:
    arguments = (
        item.arguments
        if isinstance(item, ResponseFunctionToolCallParam)
        else json.dumps({"input": item.input})
    )
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": offered_name(item.namespace, item.name), "arguments": arguments},
    }


def messages_for_node(items: list) -> list[dict[str, Any]]:
    """Input items → chat messages; consecutive calls join the assistant message before them."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, EasyInputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _parts(item.content)})
        elif isinstance(item, ResponseFunctionToolCallParam | ResponseCustomToolCallParam):
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(item))
        elif isinstance(item, FunctionCallOutput | ResponseCustomToolCallOutputParam):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id or "", "content": _text(item.output)}
            )
        elif not isinstance(item, AdditionalTools):
            log.debug(
                "input item %s (%s) is not shown to the model", item.type, getattr(item, "id", None)
            )
    return out
