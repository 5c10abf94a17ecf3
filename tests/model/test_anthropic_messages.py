"""The default model through the whole system with the official anthropic client."""

import json

import anthropic
import pytest

pytestmark = pytest.mark.model
MODEL = "default"
GREEDY = {"temperature": 0}  # the SDK no longer names sampling fields; the API still takes them
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}
CLAUDE_CODE_TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "maxLength": 80},
                "description": {"type": "string", "maxLength": 80},
            },
            "required": ["command"],
        },
    },
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string", "maxLength": 80}},
            "required": ["file_path"],
        },
    },
]
SYSTEM = [
    {"type": "text", "text": "You are Claude Code, a coding assistant."},
    {
        "type": "text",
        "text": "Use tools to inspect the repository.",
        "cache_control": {"type": "ephemeral"},
    },
]


def test_create_answers_with_text(anthropic_client):
    reply = anthropic_client.messages.create(
        model=MODEL, max_tokens=40, messages=FRANCE, extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.content[0].type == "text" and "Paris" in reply.content[0].text
    assert reply.stop_reason == "end_turn"
    assert reply.usage.input_tokens > 10 and reply.usage.output_tokens > 3


def test_streamed_and_whole_answers_carry_the_same_content_event_by_event(anthropic_client):
    whole = anthropic_client.messages.create(
        model=MODEL, max_tokens=40, messages=FRANCE, extra_body=GREEDY
    )
    with anthropic_client.messages.stream(
        model=MODEL, max_tokens=40, messages=FRANCE, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [
        e
        for e in events
        if e.type
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # blocks open, take deltas and close in order, one at a time
    text, open_index = {}, None
    for event in raw[1:-2]:
        if event.type == "content_block_start":
            assert open_index is None
            open_index = event.index
            text[event.index] = event.content_block.text
        elif event.type == "content_block_delta":
            assert event.index == open_index and event.delta.type == "text_delta"
            text[event.index] += event.delta.text
        else:
            assert event.index == open_index
            open_index = None
    assert [text[i] for i in sorted(text)] == [b.text for b in whole.content]
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_text_helper(anthropic_client):
    with anthropic_client.messages.stream(
        model=MODEL, max_tokens=40, messages=FRANCE, extra_body=GREEDY
    ) as stream:
        assert "Paris" in "".join(stream.text_stream)


def test_forced_tool_use_and_tool_result_round_trip(anthropic_client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "tool_use"
    [call] = [b for b in reply.content if b.type == "tool_use"]
    assert (
        call.name == "get_weather"
        and isinstance(call.input["city"], str)
        and call.id.startswith("toolu_")
    )
    history = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees"}
            ],
        },
    ]
    answer = anthropic_client.messages.create(
        model=MODEL, max_tokens=40, messages=history, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content


def test_any_tool_streams_input_json(anthropic_client):
    with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=80,
        tools=[WEATHER],
        extra_body=GREEDY,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Rome?"}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    [call] = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == call.input and isinstance(call.input["city"], str)
    assert final.stop_reason == "tool_use"


def test_claude_code_like_conversation(anthropic_client):
    """System blocks, several turns, tool_use and tool_result, streaming, as Claude Code sends them."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "List the files in this repository."}],
        }
    ]
    with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=80,
        system=SYSTEM,
        tools=CLAUDE_CODE_TOOLS,
        tool_choice={"type": "tool", "name": "Bash"},
        messages=messages,
        metadata={"user_id": "session-1"},
        extra_body=GREEDY,
    ) as stream:
        first = stream.get_final_message()
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "Bash" and isinstance(call.input["command"], str)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "README.md\nsetup.py"}],
                },
                {"type": "text", "text": "Now read the README."},
            ],
        },
    ]
    with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=80,
        system=SYSTEM,
        tools=CLAUDE_CODE_TOOLS,
        tool_choice={"type": "any"},
        messages=messages,
        extra_body=GREEDY,
    ) as stream:
        second = stream.get_final_message()
    calls = [b for b in second.content if b.type == "tool_use"]
    assert (
        calls
        and all(c.name in ("Bash", "Read") for c in calls)
        and second.stop_reason == "tool_use"
    )
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in second.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": "# Demo"} for c in calls
            ],
        },
    ]
    with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=30,
        system=SYSTEM,
        tools=CLAUDE_CODE_TOOLS,
        messages=messages,
        extra_body=GREEDY,
    ) as stream:
        third = stream.get_final_message()
    assert third.content and third.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = anthropic_client.messages.count_tokens(
        model=MODEL, system=SYSTEM, tools=CLAUDE_CODE_TOOLS, messages=messages
    )
    assert count.input_tokens == third.usage.input_tokens


def test_count_tokens_equals_usage(anthropic_client):
    reply = anthropic_client.messages.create(model=MODEL, max_tokens=5, messages=FRANCE)
    assert (
        anthropic_client.messages.count_tokens(model=MODEL, messages=FRANCE).input_tokens
        == reply.usage.input_tokens
    )


def test_sdk_raises_its_own_errors(anthropic_client):
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(
            model=MODEL, max_tokens=5, messages=FRANCE, extra_body={"temperature": 3}
        )
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.create(model="no-such-model", max_tokens=5, messages=FRANCE)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.InternalServerError) as caught:
        anthropic_client.messages.create(model="unservable", max_tokens=5, messages=FRANCE)
    assert caught.value.status_code == 503


def test_output_config_json_schema_validates(anthropic_client):
    person = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0},
        },
    }
    reply = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person."}],
        output_config={"format": {"type": "json_schema", "schema": person}},
        extra_body=GREEDY,
    )
    value = json.loads(reply.content[0].text)
    assert set(value) == {"name", "age"} and value["age"] >= 0
