"""Ollama requests → the GenerationRequest a node runs: options, format, tools, images, think, raw."""

import pytest
from pydantic import ValidationError

from gateway.dialects.protocol.ollama import ChatRequest, GenerateRequest, PullRequest, ShowRequest
from gateway.dialects.tools.grammars import JsonOutput

HI = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return ChatRequest(**{"model": "m", "messages": HI} | fields).to_generation_request("job", "m")


def test_options_map_to_sampling():
    sampling = chat(
        options={
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "min_p": 0.1,
            "seed": 42,
            "stop": ["\n"],
            "num_predict": 12,
            "repeat_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "num_ctx": 8192,
            "num_gpu": 99,
            "mirostat": 2,
        }
    ).sampling
    assert (
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.min_p,
        sampling.seed,
    ) == (0, 0.5, 7, 0.1, 42)
    assert (sampling.stop, sampling.max_tokens, sampling.repetition_penalty) == (["\n"], 12, 1.2)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)


def test_unset_options_take_the_gateways_defaults():
    sampling = chat().sampling
    assert (sampling.temperature, sampling.top_k, sampling.max_tokens, sampling.seed) == (
        1.0,
        0,
        None,
        None,
    )


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_without_a_limit_runs_to_the_models_default(num_predict):
    assert chat(options={"num_predict": num_predict}).sampling.max_tokens is None


def test_a_negative_seed_is_random():
    assert chat(options={"seed": -1}).sampling.seed is None


def test_streaming_is_the_default():
    assert ChatRequest(model="m", messages=HI).stream is True
    assert GenerateRequest(model="m", prompt="x").stream is True


def test_format_is_json_output_under_a_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert ChatRequest(model="m", messages=HI, format="json").constraint == JsonOutput(
        None, "format"
    )
    assert ChatRequest(model="m", messages=HI, format=schema).constraint == JsonOutput(
        schema, "format"
    )
    assert ChatRequest(model="m", messages=HI, format="").constraint is None
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        ChatRequest(model="m", messages=HI, format={"type": "nonsense"})


def test_images_become_image_parts_before_the_text():
    request = chat(messages=[{"role": "user", "content": "What is it?", "images": ["aGVsbG8="]}])
    assert request.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/*;base64,aGVsbG8="}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]


def test_tool_calls_and_results_in_history():
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
    request = chat(
        tools=tools,
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": None,
                "thinking": "hmm",
                "tool_calls": [{"function": {"name": "Bash", "arguments": {"command": "ls"}}}],
            },
            {"role": "tool", "content": "a.txt", "tool_name": "Bash"},
        ],
    )
    assert request.tools == tools
    assert request.messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1_0",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": {"command": "ls"}},
                }
            ],
        },
        {"role": "tool", "content": "a.txt", "name": "Bash"},
    ]


@pytest.mark.parametrize(
    "think, kwargs",
    [
        (None, {}),
        (True, {"enable_thinking": True}),
        (False, {"enable_thinking": False}),
        ("high", {"enable_thinking": True, "reasoning_effort": "high"}),
    ],
)
def test_think_reaches_the_template(think, kwargs):
    assert chat(think=think).chat_template_kwargs == kwargs


def test_logprobs():
    sampling = chat(logprobs=True, top_logprobs=3).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)


def test_generate_is_a_user_turn_after_the_system_prompt_or_raw():
    body = GenerateRequest(model="m", prompt="Why?", system="Be brief.", images=["aGVsbG8="])
    request = body.to_generation_request("job", "m")
    assert request.kind == "chat" and request.messages[0] == {
        "role": "system",
        "content": "Be brief.",
    }
    assert request.messages[1]["content"][-1] == {"type": "text", "text": "Why?"}
    raw = GenerateRequest(model="m", prompt="<s>Why?", raw=True).to_generation_request("job", "m")
    assert (raw.kind, raw.prompt, raw.messages) == ("completion", "<s>Why?", None)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"suffix": "}"}, "suffix"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2]}, "context"),
        ({"raw": True, "system": "x"}, "raw"),
        ({"options": {"top_p": 0}}, "top_p"),
        ({"keep_alive": "forever"}, "keep_alive"),
    ],
)
def test_generate_refuses_what_it_cannot_run(fields, words):
    with pytest.raises(ValidationError, match=words):
        GenerateRequest(model="m", prompt="x", **fields)


def test_keep_alive_in_seconds():
    assert GenerateRequest(model="m", prompt="x", keep_alive="5m").keep_alive_s == 300
    assert GenerateRequest(model="m", prompt="x", keep_alive=-1).keep_alive_s == -1


def test_model_routes_take_the_older_name_field():
    assert ShowRequest.model_validate({"name": "m"}).model == "m"
    assert PullRequest.model_validate({"model": "m"}).stream is True
