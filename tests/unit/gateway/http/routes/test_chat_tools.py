"""Tools and structured output on /v1/chat/completions against a scripted node."""

import json

import pytest

from tests.unit.gateway.conftest import delta, done
from tests.unit.gateway.http.routes.test_chat import sse_payloads

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = {
    "model": "default",
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [WEATHER],
}


def tool_script(entry):
    return [
        delta('<tool_call>\n{"name": "get_weather", '),
        delta('"arguments": {"city"'),
        delta(': "Paris"}}\n</tool_call>', finish_reason="stop"),
        done(),
    ]


async def test_tool_call_not_streamed(client, node):
    node.script = tool_script
    body = (await client.post("/v1/chat/completions", json=ASK)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert node.entries[0].request().tools == [WEATHER]


async def test_tool_call_streams_incremental_arguments(client, node):
    node.script = tool_script
    chunks = sse_payloads(
        (await client.post("/v1/chat/completions", json=ASK | {"stream": True})).text
    )[:-1]
    calls = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"][0]["delta"].get("tool_calls")
    ]
    assert (
        calls[0]["index"] == 0
        and calls[0]["id"].startswith("call_")
        and calls[0]["function"]["name"] == "get_weather"
    )
    assert len(calls) > 2  # the arguments came in pieces, as generated
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert all("id" not in c for c in calls[1:])
    assert [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]
    ] == ["tool_calls"]


async def test_text_with_tools_stays_text(client, node):
    body = (await client.post("/v1/chat/completions", json=ASK)).json()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello!",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_malformed_call_comes_back_as_text(client, node):
    node.script = lambda entry: [
        delta('<tool_call>{"name": broken</tool_call>', finish_reason="stop"),
        done(),
    ]
    body = (await client.post("/v1/chat/completions", json=ASK)).json()
    assert body["choices"][0]["message"]["content"] == '<tool_call>{"name": broken</tool_call>'
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"tool_choice": "required"}, ["<tool_call>", '"const": "get_weather"', "call){0,3}"]),
        ({"tool_choice": "required", "parallel_tool_calls": False}, ["start: call\n"]),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            ["start: call\n"],
        ),
        ({"response_format": {"type": "json_object"}}, ['"type": "object"']),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "w",
                        "schema": {"type": "object", "properties": {"t": {"type": "number"}}},
                    },
                }
            },
            ['"t": {"type": "number"}'],
        ),
    ],
)
async def test_forcing_sends_a_grammar(client, node, extra, expect):
    await client.post("/v1/chat/completions", json=ASK | extra)
    grammar = node.entries[0].request().sampling.grammar
    for piece in expect:
        assert piece in grammar


async def test_auto_and_none_send_no_grammar(client, node):
    await client.post("/v1/chat/completions", json=ASK | {"tool_choice": "auto"})
    await client.post("/v1/chat/completions", json=ASK | {"tool_choice": "none"})
    assert [e.request().sampling.grammar for e in node.entries] == [None, None]
    assert node.entries[1].request().tools is None


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 5}},
            }
        },
    ],
)
async def test_bad_forcing_is_a_400(client, node, extra):
    response = await client.post("/v1/chat/completions", json=ASK | extra)
    assert response.status_code == 400 and response.json()["error"]["param"].split(".")[0] in (
        "tool_choice",
        "response_format",
    )


async def test_tool_history_goes_back_to_the_node(client, node):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    await client.post("/v1/chat/completions", json=ASK | {"messages": messages})
    sent = node.entries[0].request().messages
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.mark.parametrize("cut", ["<tool", '<tool_call>\n{"na'])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_off_by_max_tokens_is_not_content(client, node, stream, cut):
    node.script = lambda entry: [
        delta('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n'),
        delta(cut, finish_reason="length"),
        done(),
    ]
    response = await client.post(
        "/v1/chat/completions", json=ASK | {"tool_choice": "required", "stream": stream}
    )
    if stream:
        *chunks, end = sse_payloads(response.text)
        assert end == "[DONE]" and not [
            c for c in chunks if c["choices"][0]["delta"].get("content")
        ]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        message = response.json()["choices"][0]["message"]
        assert message["content"] is None and [
            c["function"]["name"] for c in message["tool_calls"]
        ] == ["get_weather"]
