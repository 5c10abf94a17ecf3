"""The Responses API through the official openai SDK, against a real stack: stream and not, a
function tool round trip with previous_response_id, retrieve and delete."""

import json

import openai
import pytest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
FORCED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(openai_client, stream):
    ask = dict(
        model="tiny",
        input="Weather in Paris?",
        instructions="Use the tools.",
        max_output_tokens=60,
        **FORCED,
    )
    if stream:
        events = list(openai_client.responses.create(stream=True, **ask))
        kinds = [e.type for e in events]
        assert (
            kinds[:2] == ["response.created", "response.in_progress"]
            and kinds[-1] == "response.completed"
        )
        assert "response.function_call_arguments.delta" in kinds
        first = events[-1].response
    else:
        first = openai_client.responses.create(**ask)
    [call] = first.output  # the grammar allows exactly one call
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and "city" in json.loads(call.arguments)
    )
    assert first.status == "completed" and first.usage.input_tokens > 0

    second = openai_client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        max_output_tokens=6,
        tools=[WEATHER],
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along
    assert openai_client.responses.retrieve(second.id).output_text == second.output_text
    openai_client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(second.id)
    openai_client.responses.delete(first.id)


def test_structured_output_through_the_grammar(openai_client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = openai_client.responses.create(
        model="tiny",
        input="Answer in JSON",
        max_output_tokens=40,
        store=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    assert isinstance(json.loads(reply.output_text)["ok"], bool)
