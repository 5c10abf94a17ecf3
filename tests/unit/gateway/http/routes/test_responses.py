"""POST/GET/DELETE /v1/responses against a scripted node, through the official openai SDK."""

import json
import logging

import httpx
import openai
import pytest

from shared.wire import StartEvent
from tests.unit.gateway.conftest import KEYS, MODEL, delta, done, hello_script

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def tool_script(entry):
    return [
        StartEvent(prompt_tokens=9),
        delta('<tool_call>\n{"name": "get_weather", '),
        delta('"arguments": {"city": "Paris"}}\n</tool_call>', finish_reason="stop"),
        done(9, 12),
    ]


@pytest.fixture
async def sdk(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    async with openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0
    ) as c:
        yield c


async def test_text_response(sdk, node, redis):
    reply = await sdk.responses.create(
        model="default", input="hi", instructions="Be terse.", max_output_tokens=20
    )
    assert (
        reply.id == f"resp_{node.entries[0].job}"
        and reply.object == "response"
        and reply.status == "completed"
    )
    assert (
        reply.output_text == "Hello!" and reply.model == MODEL and reply.instructions == "Be terse."
    )
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        5,
        3,
        8,
    )
    sent = node.entries[0].request()
    assert sent.messages == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
    ]
    assert sent.sampling.max_tokens == 20
    assert 0 < await redis.ttl(KEYS.response(reply.id)) <= 30 * 24 * 3600


async def test_streamed_events_fold_into_the_same_response(sdk, node):
    whole = await sdk.responses.create(model="default", input="hi")
    events = [e async for e in await sdk.responses.create(model="default", input="hi", stream=True)]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello!"
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "completed"
    async with sdk.responses.stream(
        model="default", input="hi"
    ) as stream:  # the SDK's own accumulator
        assert (await stream.get_final_response()).output_text == "Hello!"


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_round_trip_with_previous_response_id(sdk, node, stream):
    node.script = tool_script
    first = await sdk.responses.create(
        model="default",
        input="Weather in Paris?",
        tools=[WEATHER],
        instructions="Use tools.",
        stream=stream,
    )
    if stream:
        events = [e async for e in first]
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        first = events[-1].response
    [call] = first.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert node.entries[0].request().tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
            },
        }
    ]

    node.script = lambda entry: [delta("It is sunny.", finish_reason="stop"), done()]
    second = await sdk.responses.create(
        model="default",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    assert node.entries[
        1
    ].request().messages == [  # instructions are not carried over, as OpenAI does
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]


async def test_input_items_as_agent_clients_send_them(sdk, node):
    await sdk.responses.create(
        model="default",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": "{}",
                "id": "fc_1",
            },
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ],
        tools=[WEATHER],
    )
    assert node.entries[0].request().messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Hello",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]


async def test_retrieve_delete_and_store_false(sdk, node):
    kept = await sdk.responses.create(model="default", input="hi")
    assert (await sdk.responses.retrieve(kept.id)).output_text == "Hello!"
    await sdk.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.delete(kept.id)
    unkept = await sdk.responses.create(model="default", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.responses.create(model="default", input="again", previous_response_id=unkept.id)
    assert caught.value.code == "previous_response_not_found"


async def test_cut_off_by_max_output_tokens_is_incomplete(sdk, node):
    node.script = lambda entry: [delta("Hel", finish_reason="length"), done()]
    reply = await sdk.responses.create(model="default", input="hi", max_output_tokens=1)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    "fields, expect",
    [
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "w",
                        "schema": {"type": "object", "properties": {"t": {"type": "number"}}},
                    }
                }
            },
            ['"t": {"type": "number"}'],
        ),
        ({"text": {"format": {"type": "json_object"}}}, ['"type": "object"']),
        ({"tools": [WEATHER], "tool_choice": "required"}, ["<tool_call>", "call){0,3}"]),
        (
            {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
            ["start: call\n"],
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
            ["start: call\n"],
        ),
    ],
)
async def test_structured_output_and_forced_calls_send_a_grammar(client, node, fields, expect):
    response = await client.post("/v1/responses", json={"model": "default", "input": "x"} | fields)
    assert response.status_code == 200, response.text
    grammar = node.entries[0].request().sampling.grammar
    assert all(piece in grammar for piece in expect), grammar


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}},
            "tool_choice",
        ),
        ({"tools": [{"type": "no_such_tool"}]}, "tools.0"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"background": True, "store": False}, "background"),
        ({"temperature": 3}, "temperature"),
        ({"input": 5}, "input"),
    ],
)
async def test_what_is_not_served_is_a_400(client, node, fields, param):
    response = await client.post("/v1/responses", json={"model": "default", "input": "x"} | fields)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(param)


# What the Codex CLI sends by default: function tools, a namespace of functions, and a hosted web search.
CLOSE = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"target": {"type": "string"}},
        "required": ["target"],
    },
}
CODEX_TOOLS = [
    WEATHER,
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [CLOSE]},
    {"type": "web_search", "external_web_access": False},
]


def namespaced_call_script(entry):
    return [
        delta(
            '<tool_call>\n{"name": "multi_agent_v1.close_agent", "arguments": {"target": "a1"}}\n</tool_call>',
            finish_reason="stop",
        ),
        done(),
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_namespace_functions_are_offered_and_hosted_tools_left_out_with_a_warning(
    client, node, caplog, stream
):
    caplog.set_level(logging.INFO, logger="gateway.jobs.streaming")
    node.script = namespaced_call_script
    body = {
        "model": "default",
        "stream": stream,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "user",
                "content": [{"type": "input_text", "text": "x"}],
            }
        ],
    }
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["warning"] == (
        '299 cortex "the model was not offered tools[2] (web_search): Cortex offers '
        'models function tools only (hosted and built-in tools do not run here)"'
    )
    sent = node.entries[0].request()
    assert [t["function"]["name"] for t in sent.tools] == [
        "get_weather",
        "multi_agent_v1.close_agent",
    ]
    assert sent.tools[1]["function"]["description"] == "Sub-agents. Close an agent."
    if stream:
        events = [
            json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
        ]
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert [(i["type"], i["namespace"], i["name"]) for i in added] == [
            ("function_call", "multi_agent_v1", "close_agent")
        ]
        reply = events[-1]["response"]
    else:
        reply = response.json()
    [call] = reply["output"]
    assert (call["type"], call["namespace"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "multi_agent_v1",
        "close_agent",
        {"target": "a1"},
    )
    assert [t["type"] for t in reply["tools"]] == [
        "function",
        "namespace",
        "web_search",
    ]  # echoed as sent
    [logged] = [r for r in caplog.records if "was not offered" in r.getMessage()]
    assert f"request={response.headers['x-request-id']}" in logged.getMessage()

    node.script = hello_script
    again = await client.post(
        "/v1/responses",
        json={
            "model": "default",
            "previous_response_id": reply["id"],
            "tools": CODEX_TOOLS,
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": "closed",
                    "id": "fco_1",
                    "status": "completed",
                }
            ],
        },
    )
    assert again.status_code == 200, again.text
    assert node.entries[1].request().messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {
                        "name": "multi_agent_v1.close_agent",
                        "arguments": call["arguments"],
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": "closed"},
    ]


async def test_only_function_tools_means_no_warning(client, node):
    response = await client.post(
        "/v1/responses", json={"model": "default", "input": "x", "tools": [WEATHER]}
    )
    assert response.status_code == 200 and "warning" not in response.headers


async def test_a_namespaced_function_forced_by_tool_choice_decodes_under_a_grammar(client, node):
    response = await client.post(
        "/v1/responses",
        json={
            "model": "default",
            "input": "x",
            "tools": CODEX_TOOLS,
            "tool_choice": {"type": "function", "name": "multi_agent_v1.close_agent"},
        },
    )
    assert response.status_code == 200, response.text
    grammar = node.entries[0].request().sampling.grammar
    assert "multi_agent_v1.close_agent" in grammar and "get_weather" not in grammar
