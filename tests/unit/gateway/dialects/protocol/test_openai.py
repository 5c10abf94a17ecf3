"""OpenAI request validation and conversion to the wire's GenerationRequest."""

import pytest
from pydantic import ValidationError

from gateway.dialects.protocol.openai import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionStreamResponseDelta,
    CompletionRequest,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES} | fields)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Once"} | fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_completion_tokens": -5},
        {"temperature": 5},
        {"temperature": -0.1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 0},
        {"presence_penalty": 3},
        {"frequency_penalty": -2.5},
        {"top_logprobs": 21, "logprobs": True},
        {"top_logprobs": 2},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"logit_bias": {"abc": 1}},
        {"logit_bias": {"5": 101}},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema"}},
        {"parallel_tool_calls": "x"},
        {"min_p": 2},
        {"repetition_penalty": 0},
        {"top_k": -2},
        {"speculative": "medusa"},
        {"num_speculative_tokens": 0},
    ],
)
def test_chat_rejects(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_chat_converts_to_generation_request():
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        max_tokens=10,
        max_completion_tokens=20,
        temperature=0,
        top_p=0.9,
        top_k=-1,
        min_p=0.1,
        seed=7,
        stop="END",
        stop_token_ids=[2],
        ignore_eos=True,
        n=2,
        logprobs=True,
        top_logprobs=3,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"13": -100},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        chat_template_kwargs={"enable_thinking": False},
        speculative="ngram",
        num_speculative_tokens=5,
    )
    generation = request.to_generation_request("job1", "M")
    assert (generation.job, generation.model, generation.kind) == ("job1", "M", "chat")
    assert generation.messages[0] == {"role": "system", "content": "be brief"}  # developer → system
    assert generation.messages[1]["content"][1]["image_url"] == {
        "url": "data:image/png;base64,AA",
        "detail": "auto",
    }
    assert generation.messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert generation.messages[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert generation.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert generation.chat_template_kwargs == {"enable_thinking": False}
    s = generation.sampling
    assert s.max_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.9, 0, 0.1, 7)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.n) == (["END"], [2], True, 2)
    assert (s.logprobs, s.top_logprobs, s.logit_bias) == (True, 3, {13: -100.0})
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, -0.5)
    assert (s.speculative, s.num_speculative_tokens) == ("ngram", 5)


def test_chat_defaults():
    s = chat().to_generation_request("j", "M").sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.logprobs, s.stop) == (
        None,
        1.0,
        1.0,
        1,
        False,
        [],
    )
    assert (s.speculative, s.num_speculative_tokens) == (None, None)  # as the catalogue says


def test_tool_choice_none_drops_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools, tool_choice="none").to_generation_request("j", "M").tools is None


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": ["a", "b"]},
        {"prompt": [[1, 2], [3]]},
        {"prompt": []},
        {"echo": [1]},
        {"suffix": "x"},
        {"best_of": 3},
        {"logprobs": 6},
        {"max_tokens": -1},
        {"temperature": 5},
        {"n": 0},
    ],
)
def test_completion_rejects(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_completion_batch_message_is_clear():
    with pytest.raises(ValidationError, match="batches of prompts are not supported"):
        completion(prompt=["a", "b"])


@pytest.mark.parametrize(
    "prompt, expected", [("Once", "Once"), (["Once"], "Once"), ([1, 2, 3], [1, 2, 3])]
)
def test_completion_prompt_forms(prompt, expected):
    generation = completion(prompt=prompt, logprobs=2).to_generation_request("j", "M")
    assert generation.kind == "completion" and generation.prompt == expected
    assert generation.sampling.max_tokens == 16  # OpenAI's default for completions
    assert (generation.sampling.logprobs, generation.sampling.top_logprobs) == (True, 2)


def test_chunk_delta_shows_only_set_fields():
    def dumped(delta):
        choice = ChatCompletionChunkChoice(index=0, delta=delta)
        return ChatCompletionChunk(id="c", created=1, model="m", choices=[choice]).model_dump()[
            "choices"
        ][0]

    assert dumped(ChatCompletionStreamResponseDelta(content="Hi"))["delta"] == {"content": "Hi"}
    assert dumped(ChatCompletionStreamResponseDelta())["delta"] == {}
    assert dumped(ChatCompletionStreamResponseDelta())["finish_reason"] is None
