"""Responses API requests: every input item type and tool type of the spec is modelled with all its
fields (checked against the openai SDK's own types, which are generated from OpenAI's spec), what
the model is shown of each item, and what it is offered of each tool."""

import logging
import typing

import pytest
from openai.types.responses import response_create_params, response_input_item_param, tool_param
from pydantic import BaseModel, ValidationError

from gateway.dialects.protocol import lenient
from gateway.dialects.protocol.responses import ResponseCreateParams, ResponseItemList
from gateway.dialects.protocol.responses_input import ResponseInputItem
from gateway.dialects.protocol.responses_tools import Tool, ToolChoice


def _literals(annotation) -> list[str]:
    """The strings a `type` annotation allows (`Literal["a", "b"]`, optional or not)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [value for value in typing.get_args(annotation) if isinstance(value, str)]
    return [value for arg in typing.get_args(annotation) for value in _literals(arg)]


def _members(union) -> dict[str, type[BaseModel]]:
    """A discriminated union of ours → its classes by tag (`type` value)."""
    out = {}
    for member in typing.get_args(typing.get_args(union)[0]):
        cls = (
            typing.get_args(member)[0] if typing.get_origin(member) is typing.Annotated else member
        )
        out |= {tag: cls for tag in _literals(cls.model_fields["type"].annotation)}
    return out


def _spec_types(union) -> list[tuple[str, type]]:
    """The SDK's TypedDicts of a union → (each `type` value, the TypedDict)."""
    return [
        (tag, typed_dict)
        for typed_dict in typing.get_args(union)
        if typing.is_typeddict(typed_dict)
        for tag in _literals(typing.get_type_hints(typed_dict)["type"])
    ]


def _names(cls: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in cls.model_fields.items()}


@pytest.mark.parametrize(
    "union, ours",
    [
        (response_input_item_param.ResponseInputItemParam, ResponseInputItem),
        (tool_param.ToolParam, Tool),
    ],
    ids=["input items", "tools"],
)
def test_every_type_in_the_spec_is_modelled_with_every_field(union, ours):
    modelled = _members(ours)
    for tag, typed_dict in _spec_types(union):
        assert tag in modelled, f"{tag} ({typed_dict.__name__}) is not modelled"
        missing = set(typing.get_type_hints(typed_dict)) - _names(modelled[tag])
        assert not missing, (
            f"{modelled[tag].__name__} lacks {typed_dict.__name__}'s {sorted(missing)}"
        )


def test_every_tool_choice_in_the_spec_is_modelled():
    literal, objects = typing.get_args(ToolChoice)
    modelled = set(_literals(literal)) | set(_members(objects))
    for choice in typing.get_args(response_create_params.ToolChoice):
        tags = (
            _literals(choice)
            if typing.get_origin(choice) is typing.Literal
            else _literals(typing.get_type_hints(choice)["type"])
        )
        assert set(tags) <= modelled, getattr(choice, "__name__", choice)


def request(*items, **fields) -> ResponseCreateParams:
    return ResponseCreateParams.model_validate({"model": "m", "input": list(items)} | fields)


CALLER = {"type": "direct"}
# One of each item type, every field filled in as an agent client sends them back.
SHOWN = [
    (
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be brief."}],
            "id": "msg_0",
            "status": "completed",
        },
        {"role": "system", "content": "Be brief."},
    ),
    ({"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}),
    (
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "phase": "final_answer",
            "content": [
                {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []},
                {"type": "refusal", "refusal": "."},
            ],
        },
        {"role": "assistant", "content": "Hello."},
    ),
    (
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "close_agent",
            "arguments": '{"target": "a"}',
            "id": "fc_1",
            "status": "completed",
            "namespace": "multi_agent_v1",
            "caller": CALLER,
            "async": False,
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "multi_agent_v1.close_agent",
                        "arguments": '{"target": "a"}',
                    },
                }
            ],
        },
    ),
    (
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "closed"}],
            "id": "fco_1",
            "status": "completed",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "caller": CALLER,
        },
        {"role": "tool", "tool_call_id": "c1", "content": "closed"},
    ),
    (
        {
            "type": "custom_tool_call",
            "call_id": "c2",
            "name": "apply_patch",
            "input": "*** Begin Patch",
            "id": "ctc_2",
            "caller": CALLER,
            "namespace": None,
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {
                        "name": "apply_patch",
                        "arguments": '{"input": "*** Begin Patch"}',
                    },
                }
            ],
        },
    ),
    (
        {
            "type": "custom_tool_call_output",
            "call_id": "c2",
            "output": "Done!",
            "id": "ctco_2",
            "caller": CALLER,
        },
        {"role": "tool", "tool_call_id": "c2", "content": "Done!"},
    ),
]
NOT_SHOWN = [
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "s"}],
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": "t"}],
        "encrypted_content": "gAAA",
    },
    {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAA"},
    {
        "type": "file_search_call",
        "id": "fs_1",
        "queries": ["q"],
        "status": "completed",
        "results": [],
    },
    {
        "type": "web_search_call",
        "id": "ws_1",
        "status": "completed",
        "action": {"type": "search", "query": "q"},
    },
    {
        "type": "computer_call",
        "id": "cu_1",
        "call_id": "c3",
        "pending_safety_checks": [],
        "status": "completed",
        "action": {"type": "click", "x": 1, "y": 2, "button": "left"},
    },
    {
        "type": "computer_call_output",
        "call_id": "c3",
        "id": "cuo_1",
        "status": "completed",
        "output": {"type": "computer_screenshot", "image_url": "data:,"},
        "acknowledged_safety_checks": [],
    },
    {
        "type": "image_generation_call",
        "id": "ig_1",
        "result": None,
        "status": "completed",
        "size": "1024x1024",
    },
    {
        "type": "code_interpreter_call",
        "id": "ci_1",
        "code": "1+1",
        "container_id": "cnt",
        "outputs": [],
        "status": "completed",
    },
    {
        "type": "local_shell_call",
        "id": "ls_1",
        "call_id": "c4",
        "status": "completed",
        "action": {"type": "exec", "command": ["ls"], "env": {}},
    },
    {"type": "local_shell_call_output", "id": "c4", "output": "{}", "status": "completed"},
    {
        "type": "shell_call",
        "call_id": "c5",
        "action": {"commands": ["ls"]},
        "id": "sh_1",
        "status": "completed",
        "caller": CALLER,
        "environment": {"type": "local"},
    },
    {
        "type": "shell_call_output",
        "call_id": "c5",
        "output": [],
        "id": "sho_1",
        "max_output_length": 10,
        "caller": CALLER,
        "status": "completed",
    },
    {
        "type": "apply_patch_call",
        "call_id": "c6",
        "status": "completed",
        "id": "ap_1",
        "caller": CALLER,
        "operation": {"type": "delete_file", "path": "x"},
    },
    {
        "type": "apply_patch_call_output",
        "call_id": "c6",
        "status": "completed",
        "id": "apo_1",
        "output": "ok",
    },
    {"type": "mcp_list_tools", "id": "ml_1", "server_label": "s", "tools": [], "error": None},
    {
        "type": "mcp_approval_request",
        "id": "mr_1",
        "arguments": "{}",
        "name": "t",
        "server_label": "s",
    },
    {
        "type": "mcp_approval_response",
        "approval_request_id": "mr_1",
        "approve": True,
        "id": "ma_1",
        "reason": "ok",
    },
    {
        "type": "mcp_call",
        "id": "mc_1",
        "arguments": "{}",
        "name": "t",
        "server_label": "s",
        "output": "o",
        "status": "completed",
        "approval_request_id": "mr_1",
        "error": None,
    },
    {
        "type": "tool_search_call",
        "id": "ts_1",
        "call_id": "c7",
        "arguments": {"q": 1},
        "execution": "client",
        "status": "completed",
    },
    {
        "type": "tool_search_output",
        "id": "tso_1",
        "call_id": "c7",
        "tools": [],
        "execution": "client",
        "status": "completed",
    },
    {
        "type": "configuration_update",
        "id": "cu_2",
        "reasoning": {"effort": "low"},
        "text": {"verbosity": "low"},
    },
    {"type": "program", "id": "p_1", "call_id": "c8", "code": "1", "fingerprint": "f"},
    {"type": "program_output", "id": "po_1", "call_id": "c8", "result": "1", "status": "completed"},
]


def test_each_item_is_shown_as_its_chat_message_or_not_at_all_and_no_field_is_unknown(caplog):
    caplog.set_level(logging.DEBUG)
    lenient._noted.clear()
    items = [item for item, _ in SHOWN] + NOT_SHOWN
    body = request(*items)
    shown = [message for _, message in SHOWN]
    shown[2:4] = [
        shown[2] | {"tool_calls": shown[3]["tool_calls"]}
    ]  # a call joins the assistant message before it
    assert body.conversation == shown
    assert not lenient._noted, f"fields logged as unknown: {lenient._noted}"
    hidden = [r.getMessage() for r in caplog.records if "not shown to the model" in r.getMessage()]
    assert len(hidden) == len(NOT_SHOWN) and all(
        r.levelno == logging.DEBUG for r in caplog.records if "not shown" in r.getMessage()
    )


@pytest.mark.parametrize(
    "item, where",
    [
        ({"type": "item_reference", "id": "msg_1"}, "input.0.item_reference"),
        ({"id": "msg_1"}, "input.0.item_reference"),  # `type` is optional for a reference
        ({"type": "compaction_trigger"}, "input.0.compaction_trigger"),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
            "input.0.message.content.0",
        ),
        ({"type": "no_such_item"}, "input.0"),
    ],
)
def test_items_that_cannot_be_served_are_refused_saying_why(item, where):
    with pytest.raises(ValidationError) as caught:
        request(item)
    [error] = caught.value.errors()
    assert ".".join(map(str, error["loc"])).startswith(where)


CLOSE = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
    "defer_loading": False,
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [CLOSE, {"type": "custom", "name": "freeform", "format": {"type": "text"}}],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {}},
    "output_schema": {"type": "string"},
    "allowed_callers": ["direct"],
}
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["v"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {
        "type": "computer_use_preview",
        "display_width": 1,
        "display_height": 1,
        "environment": "linux",
    },
    {"type": "computer"},
    {"type": "image_generation", "quality": "low"},
    {"type": "mcp", "server_label": "s", "server_url": "u"},
    {"type": "local_shell"},
    {"type": "shell"},
    {"type": "apply_patch"},
    {"type": "tool_search"},
    {"type": "web_search_preview"},
    {"type": "programmatic_tool_calling"},
    {"type": "custom", "name": "raw", "description": "free text"},
]


def test_functions_and_namespaces_are_offered_and_every_other_tool_left_out_by_name():
    lenient._noted.clear()
    body = request({"role": "user", "content": "hi"}, tools=[WEATHER, NAMESPACE, *HOSTED])
    assert not lenient._noted, f"fields logged as unknown: {lenient._noted}"
    sent = body.to_generation_request("j", "m").tools
    assert sent == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER["parameters"]},
        },
        {
            "type": "function",
            "function": {
                "name": "multi_agent_v1.close_agent",
                "description": "Sub-agents. Close an agent.",
                "parameters": CLOSE["parameters"],
            },
        },
    ]
    assert body.offer.called("multi_agent_v1.close_agent") == ("multi_agent_v1", "close_agent")
    assert body.offer.called("get_weather") == (None, "get_weather")
    assert body.offer.left_out == ["tools[1].tools[1] (custom 'freeform')"] + [
        f"tools[{i}] ({tool['type']})" for i, tool in enumerate(HOSTED, start=2)
    ]
    assert "tools[2] (web_search)" in body.offer.warning


def test_additional_tools_items_join_the_offer():
    body = request(
        {"role": "user", "content": "hi"},
        {
            "type": "additional_tools",
            "role": "developer",
            "tools": [WEATHER, HOSTED[0]],
            "id": "at_1",
        },
    )
    assert [t["function"]["name"] for t in body.to_generation_request("j", "m").tools] == [
        "get_weather"
    ]
    assert body.offer.left_out == ["input[1].tools[1] (web_search)"]


@pytest.mark.parametrize(
    "choice, message",
    [
        (
            {"type": "web_search_preview"},
            "tool_choice: forces a web_search_preview tool, which does not run here",
        ),
        ({"type": "mcp", "server_label": "s"}, "tool_choice: forces a mcp tool"),
        ({"type": "custom", "name": "freeform"}, "tool_choice: forces a custom tool"),
        (
            {"type": "function", "name": "close_agent"},
            "tool_choice: names function 'close_agent', which is not in tools",
        ),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "nope"}],
            },
            "tool_choice: names function 'nope'",
        ),
    ],
)
def test_a_tool_choice_that_forces_a_tool_not_offered_is_refused(choice, message):
    with pytest.raises(ValidationError) as caught:
        request(
            {"role": "user", "content": "hi"},
            tools=[WEATHER, NAMESPACE, *HOSTED],
            tool_choice=choice,
        )
    assert message in str(caught.value)


def test_only_hosted_tools_with_a_required_choice_is_refused():
    with pytest.raises(ValidationError, match="tool_choice: requires function tools"):
        request({"role": "user", "content": "hi"}, tools=HOSTED[:2], tool_choice="required")


def test_a_namespaced_function_can_be_forced_and_allowed_tools_narrow_the_offer():
    named = request(
        {"role": "user", "content": "hi"},
        tools=[WEATHER, NAMESPACE],
        tool_choice={"type": "function", "name": "multi_agent_v1.close_agent"},
    )
    assert [t["name"] for t in named.constraint.tools] == ["multi_agent_v1.close_agent"]
    allowed = request(
        {"role": "user", "content": "hi"},
        tools=[WEATHER, NAMESPACE],
        tool_choice={
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [
                {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
                {"type": "web_search"},
            ],
        },
    )
    assert [t["function"]["name"] for t in allowed.to_generation_request("j", "m").tools] == [
        "multi_agent_v1.close_agent"
    ]
    assert allowed.constraint is None
    required = allowed.model_copy(
        update={"tool_choice": allowed.tool_choice.model_copy(update={"mode": "required"})}
    )
    assert [t["name"] for t in required.constraint.tools] == ["multi_agent_v1.close_agent"]


def test_input_items_come_in_pages_after_an_id():
    items = [{"id": f"i{n}"} for n in range(5)]
    first = ResponseItemList.page(items, 2, None)
    assert (
        [i["id"] for i in first.data] == ["i0", "i1"] and first.has_more and first.last_id == "i1"
    )
    rest = ResponseItemList.page(items, 10, first.last_id)
    assert (
        [i["id"] for i in rest.data] == ["i2", "i3", "i4"]
        and not rest.has_more
        and rest.first_id == "i2"
    )
    assert ResponseItemList.page(items, 2, "unknown").data == []
