"""Tools and structured output on the default model with the official openai client."""

import json

import openai
import pytest

pytestmark = pytest.mark.model
MODEL = "default"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
}


def test_tools_round_trip(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
    )
    choice = reply.choices[0]
    assert (
        choice.finish_reason == "tool_calls" and choice.message.tool_calls
    )  # parallel calls allowed
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(
            json.loads(call.function.arguments)["city"], str
        )
    history = (
        ASK
        + [choice.message.model_dump(exclude_none=True)]
        + [
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"}
            for call in choice.message.tool_calls
        ]
    )
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_one_forced_call_without_parallel_calls(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert (
        len(reply.choices[0].message.tool_calls) == 1
        and reply.choices[0].finish_reason == "tool_calls"
    )


def test_named_tool_call_streams_argument_deltas(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            temperature=0,
            max_tokens=80,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2
    assert isinstance(json.loads("".join(d.function.arguments or "" for d in deltas))["city"], str)
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]


def test_json_schema_output_validates(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    value = json.loads(reply.choices[0].message.content)
    assert (
        set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and 0 <= value["age"] <= 150
    )


def test_json_object_output_parses(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL,
        temperature=0.7,
        seed=1,
        max_tokens=120,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object with a colour."}],
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_sdk_raises_its_own_errors(openai_client):
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="no-such-model", messages=ASK)
    with pytest.raises(openai.InternalServerError) as caught:
        openai_client.chat.completions.create(model="unservable", messages=ASK)
    assert caught.value.status_code == 503
