"""Responses API tools: every type of `tools` and `tool_choice` in the spec, named and ordered as
the spec has them, and what the model is offered of them (`offer`).

The model is offered `function` tools and the functions of `namespace` tools; a namespace's
function under the name `namespace.function` (`offered_name`), and a call of it comes back as a
`function_call` item with `namespace` and `name` apart, as OpenAI reports it. Every other tool
type is accepted and left out of what the model sees: the hosted tools OpenAI runs on its side
(web search, file search, code interpreter, computer use, image generation, MCP, tool search,
programmatic tool calling), the built-in tools a model must be trained for (`local_shell`,
`shell`, `apply_patch`) and `custom` tools (free-form input). The response names what was left
out in a `Warning` header; a `tool_choice` that forces such a tool is a 400.
"""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.dialects.protocol.bounds import JsonSchema
from gateway.dialects.protocol.lenient import Lenient

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
Callers = list[Literal["direct", "programmatic"]] | None


class FunctionTool(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    parameters: JsonSchema | None = None
    strict: bool | None = None
    type: Literal["function"]
    allowed_callers: Callers = None  # accepted, not used
    async_: bool | None = Field(None, alias="async")  # accepted, not used
    defer_loading: bool | None = (
        None  # accepted: the function is offered from the start (there is no tool search)
    )
    description: str | None = None
    output_schema: dict[str, Any] | None = None  # accepted, not used


class CustomTool(Lenient):
    """A tool whose input is free-form text (or follows a grammar): not offered."""

    name: str = Field(pattern=FUNCTION_NAME)
    type: Literal["custom"]
    allowed_callers: Callers = None
    async_: bool | None = Field(None, alias="async")
    defer_loading: bool | None = None
    description: str | None = None
    format: dict[str, Any] | None = None


class NamespaceTool(Lenient):
    """Functions (and custom tools) grouped under a name the model calls them by."""

    description: str | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]
    type: Literal["namespace"]


# ---- tools this gateway cannot run: accepted, not offered (their settings are not read) ----------


class FileSearchTool(Lenient):
    type: Literal["file_search"]
    vector_store_ids: list[str] | None = None
    filters: Any = None
    max_num_results: int | None = None
    ranking_options: Any = None


class ComputerTool(Lenient):
    type: Literal["computer"]


class ComputerUsePreviewTool(Lenient):
    display_height: int | None = None
    display_width: int | None = None
    environment: str | None = None
    type: Literal["computer_use_preview"]


class WebSearchTool(Lenient):
    type: Literal["web_search", "web_search_2025_08_26"]
    external_web_access: bool | None = None
    filters: Any = None
    search_context_size: str | None = None
    user_location: Any = None


class McpTool(Lenient):
    server_label: str
    type: Literal["mcp"]
    allowed_callers: Callers = None
    allowed_tools: Any = None
    authorization: str | None = None
    connector_id: str | None = None
    defer_loading: bool | None = None
    headers: dict[str, str] | None = None
    require_approval: Any = None
    server_description: str | None = None
    server_url: str | None = None
    tunnel_id: str | None = None


class CodeInterpreterTool(Lenient):
    container: str | dict[str, Any]
    type: Literal["code_interpreter"]
    allowed_callers: Callers = None


class ProgrammaticToolCallingTool(Lenient):
    type: Literal["programmatic_tool_calling"]


class ImageGenerationTool(Lenient):
    type: Literal["image_generation"]
    action: str | None = None
    background: str | None = None
    complexity: str | None = None
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    input_fidelity: str | None = None
    input_image_mask: dict[str, Any] | None = None
    model: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    output_format: str | None = None
    partial_images: int | None = None
    quality: str | None = None
    size: str | None = None
    svg: dict[str, Any] | None = None


class LocalShellTool(Lenient):
    type: Literal["local_shell"]


class ShellTool(Lenient):
    type: Literal["shell"]
    allowed_callers: Callers = None
    environment: Any = None


class ToolSearchTool(Lenient):
    type: Literal["tool_search"]
    description: str | None = None
    execution: Literal["server", "client"] | None = None
    parameters: Any = None


class WebSearchPreviewTool(Lenient):
    type: Literal["web_search_preview", "web_search_preview_2025_03_11"]
    search_content_types: list[str] | None = None
    search_context_size: str | None = None
    user_location: Any = None


class ApplyPatchTool(Lenient):
    type: Literal["apply_patch"]
    allowed_callers: Callers = None


Tool = Annotated[
    FunctionTool
    | FileSearchTool
    | ComputerTool
    | ComputerUsePreviewTool
    | WebSearchTool
    | McpTool
    | CodeInterpreterTool
    | ProgrammaticToolCallingTool
    | ImageGenerationTool
    | LocalShellTool
    | ShellTool
    | CustomTool
    | NamespaceTool
    | ToolSearchTool
    | WebSearchPreviewTool
    | ApplyPatchTool,
    Field(discriminator="type"),
]

# ---- tool_choice -------------------------------------------------------------------------------------


class ToolChoiceFunction(Lenient):
    name: str  # as the model is offered it: `namespace.function` for a namespace's
    type: Literal["function"]


class ToolChoiceAllowed(Lenient):
    """Only these tools (`{"type": "function", "name": …}`; others name tools that are not offered anyway)."""

    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]
    type: Literal["allowed_tools"]


class ToolChoiceUnservable(Lenient):
    """Forces a tool the model is never offered: refused with a 400."""

    type: Literal[
        "file_search",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "computer",
        "computer_use_preview",
        "computer_use",
        "image_generation",
        "code_interpreter",
        "mcp",
        "custom",
        "programmatic_tool_calling",
        "apply_patch",
        "shell",
        "local_shell",
        "tool_search",
    ]
    name: str | None = None  # mcp, custom
    server_label: str | None = None  # mcp


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[
        ToolChoiceFunction | ToolChoiceAllowed | ToolChoiceUnservable, Field(discriminator="type")
    ]
)

# ---- what the model is offered -------------------------------------------------------------------------


def offered_name(namespace: str | None, name: str) -> str:
    """The name the model knows a function by."""
    return f"{namespace}.{name}" if namespace else name


@dataclass(frozen=True)
class Function:
    """A function the model is offered; a namespace's carries the namespace's name and description."""

    tool: FunctionTool
    namespace: str | None = None
    namespace_description: str | None = None

    @property
    def name(self) -> str:
        return offered_name(self.namespace, self.tool.name)

    def for_node(self) -> dict[str, Any]:
        """As a chat tool (`{"type": "function", "function": …}`), the way chat templates take it."""
        described = (
            " ".join(filter(None, [self.namespace_description, self.tool.description])) or None
        )
        function = {"name": self.name, "description": described, "parameters": self.tool.parameters}
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


@dataclass
class Offer:
    """The functions a request's tools offer the model (by the name it knows them by), and the
    tools it is not offered."""

    functions: dict[str, Function] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # "tools[8] (web_search)"

    def add(self, where: str, tools: list) -> None:
        for i, tool in enumerate(tools):
            if isinstance(tool, FunctionTool):
                self._add(Function(tool))
            elif isinstance(tool, NamespaceTool):
                for j, inner in enumerate(tool.tools):
                    if isinstance(inner, FunctionTool):
                        self._add(Function(inner, tool.name, tool.description))
                    else:
                        self.left_out.append(
                            f"{where}[{i}].tools[{j}] ({inner.type} '{inner.name}')"
                        )
            else:
                self.left_out.append(f"{where}[{i}] ({tool.type})")

    def _add(self, function: Function) -> None:
        if function.name in self.functions:
            raise ValueError(f"tools: '{function.name}' is declared twice")
        self.functions[function.name] = function

    def called(self, name: str) -> tuple[str | None, str]:
        """The (namespace, name) a call of `name` is reported under."""
        function = self.functions.get(name)
        return (function.namespace, function.tool.name) if function else (None, name)

    @property
    def warning(self) -> str | None:
        """What the `Warning` header says of the tools left out."""
        if not self.left_out:
            return None
        return (
            f"the model was not offered {', '.join(self.left_out)}: Cortex offers models function tools only "
            f"(hosted and built-in tools do not run here)"
        )
