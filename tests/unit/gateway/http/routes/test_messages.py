"""POST /v1/messages and /v1/messages/count_tokens against a scripted node."""

import json

import pytest

from gateway.dialects.protocol.anthropic import MessageCreateParams
from gateway.dialects.render.messages import content_blocks
from gateway.http.routes import messages as messages_route
from shared.wire import ErrorEvent, StartEvent
from tests.unit.gateway.conftest import MODEL, delta, done

HELLO = {"model": "default", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HEADERS = {"x-api-key": "anything", "anthropic-version": "2023-06-01"}


def sse_events(text: str, first_id: int = 0) -> list[tuple[str, dict]]:
    """(name, payload) of each named event; those but `ping` and `error` are numbered on from `first_id`."""
    out, ids = [], []
    for frame in filter(None, text.split("\n\n")):
        name_line, *id_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        payload = json.loads(data_line[6:])
        assert payload["type"] == name_line[7:]
        assert bool(id_line) == (payload["type"] not in ("ping", "error")), frame
        ids += [int(line.removeprefix("id: ")) for line in id_line]
        out.append((name_line[7:], payload))
    assert ids == list(range(first_id, first_id + len(ids)))
    return out


def tool_script(entry):
    return [
        delta("Let me check."),
        delta('\n<tool_call>\n{"name": "get_weather", '),
        delta('"arguments": {"city": '),
        delta('"Paris"}}\n</tool_call>', finish_reason="stop"),
        done(),
    ]


async def test_text_answer_not_streamed(client, node):
    response = await client.post("/v1/messages", json=HELLO, headers=HEADERS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {
        "id": f"msg_{node.entries[0].job}",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello!"}],
        "model": MODEL,
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


async def test_stream_event_order(client, node):
    response = await client.post("/v1/messages", json=HELLO | {"stream": True})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert (
        events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    )
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e["delta"]["text"] for _, e in events[3:6]] == ["Hel", "lo", "!"]
    assert events[7][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[7][1]["usage"] == {"input_tokens": 5, "output_tokens": 3}


async def test_tool_use_streamed_and_not_carry_the_same_blocks(client, node):
    node.script = tool_script
    request = HELLO | {"tools": [WEATHER]}
    whole = (await client.post("/v1/messages", json=request)).json()
    assert whole["stop_reason"] == "tool_use"
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][0]["text"] == "Let me check."
    call = whole["content"][1]
    assert (
        call["name"] == "get_weather"
        and call["input"] == {"city": "Paris"}
        and call["id"].startswith("toolu_")
    )

    events = sse_events((await client.post("/v1/messages", json=request | {"stream": True})).text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
    assert starts == ["text", "tool_use"]
    partial = [
        e["delta"]["partial_json"]
        for n, e in events
        if n == "content_block_delta" and e["index"] == 1
    ]
    assert len(partial) > 1  # the input streams as it is generated
    from gateway.dialects.protocol.anthropic import ContentBlockDeltaEvent, ContentBlockStartEvent

    folded = content_blocks(
        [
            ContentBlockStartEvent.model_validate(e)
            if n == "content_block_start"
            else ContentBlockDeltaEvent.model_validate(e)
            for n, e in events
            if n in ("content_block_start", "content_block_delta")
        ]
    )
    streamed = [b.model_dump() for b in folded]
    for block in streamed + whole["content"]:
        block.pop("id", None)
    assert streamed == whole["content"]


async def test_tools_reach_the_node_as_functions_and_history_translates(client, node):
    request = HELLO | {
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
        ],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "metadata": {"user_id": "u"},
    }
    assert (await client.post("/v1/messages", json=request)).status_code == 200
    sent = node.entries[0].request()
    assert sent.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert sent.messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    assert (
        sent.sampling.stop == ["END"]
        and sent.sampling.temperature == 0.5
        and sent.sampling.top_k == 5
    )
    assert sent.sampling.grammar is None  # auto: the model decides


@pytest.mark.parametrize(
    "choice, names",
    [
        ({"type": "any"}, ["get_weather", "get_time"]),
        ({"type": "tool", "name": "get_time"}, ["get_time"]),
    ],
)
async def test_forced_tool_choice_sends_a_grammar(client, node, choice, names):
    time_tool = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    await client.post(
        "/v1/messages", json=HELLO | {"tools": [WEATHER, time_tool], "tool_choice": choice}
    )
    grammar = node.entries[0].request().sampling.grammar
    assert grammar.startswith("start: ") and "<tool_call>" in grammar
    for name in ["get_weather", "get_time"]:
        assert (f'"const": "{name}"' in grammar) == (name in names)


async def test_stop_sequence_is_reported(client, node):
    node.script = lambda entry: [delta("Hi", finish_reason="stop", stop_sequence="END"), done()]
    body = (await client.post("/v1/messages", json=HELLO | {"stop_sequences": ["END"]})).json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"


async def test_max_tokens_stop_reason(client, node):
    node.script = lambda entry: [delta("Hi", finish_reason="length"), done()]
    assert (await client.post("/v1/messages", json=HELLO)).json()["stop_reason"] == "max_tokens"


async def test_count_tokens_is_a_count_job(client, node):
    node.script = lambda entry: [done(prompt_tokens=42, completion_tokens=0)]
    response = await client.post(
        "/v1/messages/count_tokens", json={k: v for k, v in HELLO.items() if k != "max_tokens"}
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"input_tokens": 42}
    assert node.entries[0].request().kind == "count"


@pytest.mark.parametrize(
    "body, status, kind",
    [
        (
            {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
        ),  # no max_tokens
        (HELLO | {"model": "nope"}, 404, "not_found_error"),
        (HELLO | {"temperature": 1.5}, 400, "invalid_request_error"),
        (
            HELLO | {"tool_choice": {"type": "tool", "name": "x"}, "tools": [WEATHER]},
            400,
            "invalid_request_error",
        ),
        (
            HELLO | {"context_management": {"edits": "all"}},
            400,
            "invalid_request_error",
        ),  # known field, wrong type
        (HELLO | {"messages": [{"role": "system", "content": 5}]}, 400, "invalid_request_error"),
    ],
)
async def test_errors_in_anthropic_shape(client, node, body, status, kind):
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == status
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == kind and response.json()["error"]["message"]
    assert set(response.json()["error"]) == {"type", "message"}


async def test_node_error_before_output_is_an_http_status(client, node):
    node.script = lambda entry: [ErrorEvent(code="model_unavailable", message="gone")]
    response = await client.post("/v1/messages", json=HELLO | {"stream": True})
    assert response.status_code == 503
    assert response.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "gone"},
    }


async def test_error_mid_stream_is_an_error_event(client, node):
    node.script = lambda entry: [
        delta("Hel"),
        ErrorEvent(code="node_lost", message="node went away"),
    ]
    events = sse_events((await client.post("/v1/messages", json=HELLO | {"stream": True})).text)
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "node went away"}},
    )


async def test_openai_routes_keep_the_openai_shape(client, node):
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert (
        response.status_code == 404
        and "type" not in response.json()
        and response.json()["error"]["code"]
    )


async def test_unknown_route_under_messages_is_anthropic_shaped(client):
    response = await client.get("/v1/messages/nothing-here")
    assert response.status_code in (404, 405) and response.json()["type"] == "error"


async def test_ping_while_the_model_is_quiet(client, node, monkeypatch):
    import asyncio

    monkeypatch.setattr(messages_route, "PING_INTERVAL_S", 0.01)

    node.script = lambda entry: [delta("a"), "sleep", delta("b", finish_reason="stop"), done()]

    async def answer(entry):
        node.entries.append(entry)
        for step in node.script(entry):
            if step == "sleep":
                await asyncio.sleep(0.2)
                continue
            from shared.wire import pack_event

            await node.redis.publish(entry.channel, pack_event(step))

    node._answer = answer
    events = sse_events((await client.post("/v1/messages", json=HELLO | {"stream": True})).text)
    names = [n for n, _ in events]
    assert names.count("ping") >= 2 and names[-1] == "message_stop"


def test_request_model_translates_tool_choice_none_to_no_tools():
    params = MessageCreateParams.model_validate(
        HELLO | {"tools": [WEATHER], "tool_choice": {"type": "none"}}
    )
    assert params.to_generation_request("j", MODEL).tools is None


CLAUDE_CODE = {  # the shape of Claude Code 2.1's default request (trimmed), as captured from `claude -p`
    "model": "default",
    "max_tokens": 32000,
    "stream": True,
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "<system-reminder>\nToday's date is 2026-11-23.\n</system-reminder>\n",
                },
                {"type": "text", "text": "hello there", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "system", "content": "Available agent types for the Agent tool: ..."},
    ],
    "system": [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.197.d7d; cc_entrypoint=sdk-cli;",
        },
        {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Run a command",
            "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
                "additionalProperties": False,
            },
        }
    ],
    "metadata": {"user_id": '{"device_id":"d92f","account_uuid":"","session_id":"9524"}'},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
CLAUDE_CODE_HEADERS = HEADERS | {
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27",
    "x-app": "cli",
    "anthropic-dangerous-direct-browser-access": "true",
}


async def test_claude_codes_default_request_is_accepted(client, node):
    """System messages after the user turn, context_management, thinking, max_tokens 32000, ?beta=true."""
    response = await client.post(
        "/v1/messages?beta=true", json=CLAUDE_CODE, headers=CLAUDE_CODE_HEADERS
    )
    assert response.status_code == 200, response.text
    assert [name for name, _ in sse_events(response.text)][-1] == "message_stop"
    sent = node.entries[0].request()
    assert sent.messages[0] == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=2.1.197.d7d; "
        "cc_entrypoint=sdk-cli;You are a Claude agent.\n\nAvailable agent types for the Agent tool: ...",
    }
    assert [m["role"] for m in sent.messages] == ["system", "user"]
    assert sent.sampling.max_tokens == 32000  # the node fits it to the room the prompt leaves


async def test_system_messages_fold_in_order_and_clear_at_next_user_message(client, node):
    turns = [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "a"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "gone"}],
            "clear_at": "next_user_message",
        },
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "system", "content": "last", "clear_at": "next_user_message"},
    ]
    assert (
        await client.post("/v1/messages", json=HELLO | {"system": "top", "messages": turns})
    ).status_code == 200
    assert node.entries[0].request().messages == [
        {"role": "system", "content": "top\n\nfirst\n\nlast"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]


async def test_message_start_reports_the_prompts_tokens(client, node):
    node.script = lambda entry: [
        StartEvent(prompt_tokens=17),
        delta("Hi", finish_reason="stop"),
        done(prompt_tokens=17),
    ]
    events = sse_events((await client.post("/v1/messages", json=HELLO | {"stream": True})).text)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 17


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_cut_off_by_max_tokens_is_not_text(client, node, stream):
    node.script = lambda entry: [
        delta('<tool_call>\n{"na'),
        delta('me": "get_wea', finish_reason="length"),
        done(),
    ]
    response = await client.post(
        "/v1/messages",
        json=HELLO | {"tools": [WEATHER], "tool_choice": {"type": "any"}, "stream": stream},
    )
    if stream:
        events = sse_events(response.text)
        assert not [e for n, e in events if n == "content_block_delta" and e["delta"].get("text")]
        assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    else:
        assert response.json()["content"] == [{"type": "text", "text": ""}]
        assert response.json()["stop_reason"] == "max_tokens"
