"""max_tokens beyond the room the prompt leaves, and requests that give none; the prompt's length
in Anthropic's message_start; echo; models by alias."""

import anthropic
import openai
import pytest

RANDOM = {"ignore_eos": True}  # a random model may end at once; these tests count tokens


def test_max_tokens_beyond_the_room_is_clamped(openai_client):
    reply = openai_client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=100_000, extra_body=RANDOM
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 256


def test_the_reject_policy_keeps_openais_400(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(
            model="tiny-strict", prompt="Hello there", max_tokens=100_000
        )
    assert caught.value.code == "context_length_exceeded"


def test_a_request_without_max_tokens_gets_the_models_default(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go on"}], extra_body=RANDOM
    )
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 8)


def test_message_start_carries_the_real_input_tokens(stack):
    client = anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0)
    with client.messages.stream(
        model="tiny",
        max_tokens=4,
        messages=[{"role": "user", "content": "Hi there"}],
        extra_body=RANDOM,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == final.usage.input_tokens > 0


def test_echo_puts_the_prompt_first(openai_client, smol_tokenizer):
    text = (
        openai_client.completions.create(
            model="tiny", prompt="The capital", echo=True, max_tokens=3
        )
        .choices[0]
        .text
    )
    assert text.startswith("The capital")
    ids = smol_tokenizer.encode("Once upon a time", add_special_tokens=False)
    text = (
        openai_client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=3)
        .choices[0]
        .text
    )
    assert text.startswith("Once upon a time")


def test_models_by_id_and_alias(openai_client):
    assert "default" in [m.id for m in openai_client.models.list().data]
    assert openai_client.models.retrieve("default").model_extra["root"] == "tiny"
    assert openai_client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
