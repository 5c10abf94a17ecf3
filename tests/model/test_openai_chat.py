"""The default model through the whole system with the official openai client."""

import json
import threading

import httpx
import openai
import pytest

from shared.keys import CONSUMER_GROUP
from shared.settings import GatewaySettings

pytestmark = pytest.mark.model
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL_ID = "SmolLM2-135M-Instruct"


def test_france_is_paris_not_streamed(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=FRANCE, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert (
        reply.id.startswith("chatcmpl-")
        and reply.model == MODEL_ID
        and reply.object == "chat.completion"
    )
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_france_is_paris_streamed_with_usage(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="default",
            messages=FRANCE,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 3
    assert len({c.id for c in chunks}) == 1


def test_completions_both_modes(openai_client):
    prompt = "The capital of France is"
    whole = openai_client.completions.create(
        model="default", prompt=prompt, max_tokens=8, temperature=0
    )
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in (
        "length",
        "stop",
    )
    streamed = "".join(
        c.choices[0].text
        for c in openai_client.completions.create(
            model="default", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text and "Paris" in streamed


def test_models_lists_the_default_model(openai_client):
    assert MODEL_ID in [m.id for m in openai_client.models.list().data]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"model": "default", "messages": [', 400, None),
        ('{"model": "default"}', 400, "messages"),
        (
            '{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "model",
        ),
        (
            '{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
            400,
            "max_tokens",
        ),
        (
            '{"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}',
            400,
            "temperature",
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_service_goes_on(
    clean_smol, openai_client, body, status, param
):
    response = httpx.post(
        f"{clean_smol.gateway_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    reply = openai_client.chat.completions.create(
        model="default", messages=FRANCE, temperature=0, max_tokens=8
    )
    assert reply.choices[0].message.content


def test_sdk_raises_its_own_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="nope", messages=FRANCE)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="default", messages=FRANCE, temperature=5)


def test_over_long_prompt_is_context_length_exceeded(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "word " * 3000}]
        )
    assert caught.value.code == "context_length_exceeded"
    # max_tokens beyond the context runs with what fits (the catalogue's default max_tokens_policy, "clamp")
    clamped = openai_client.chat.completions.create(
        model="default", messages=FRANCE, max_tokens=5000, temperature=0
    )
    assert "Paris" in clamped.choices[0].message.content


def test_image_for_a_text_only_model_is_refused(openai_client):
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    with pytest.raises(openai.BadRequestError, match="text-only"):
        openai_client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}]
        )


def _stream_text(client, messages, **kw) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(
        model="default", messages=messages, stream=True, **kw
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Who wrote Hamlet?",
    "Tell me a joke.",
    "What is Python?",
    "Describe a cat.",
    "What is the sun?",
    "Say hello in Spanish.",
    "What is rain?",
    "Name a planet.",
    "What do bees make?",
    "Count to five.",
    "What is a tree?",
    "Why is the sky blue?",
]


def test_sixteen_concurrent_greedy_streams_equal_each_alone(openai_client):
    ask = lambda q: _stream_text(
        openai_client, [{"role": "user", "content": q}], temperature=0, max_tokens=24
    )
    alone = {q: ask(q) for q in QUESTIONS}
    together: dict[str, tuple[str, str]] = {}
    threads = [
        threading.Thread(target=lambda q=q: together.__setitem__(q, ask(q))) for q in QUESTIONS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone
    assert all(finish in ("stop", "length") for _, finish in together.values())


def test_sampling_controls(openai_client):
    story = [{"role": "user", "content": "Tell me a story about a dragon."}]
    seeded = lambda seed: (
        openai_client.chat.completions.create(
            model="default", messages=story, temperature=1.0, seed=seed, max_tokens=20
        )
        .choices[0]
        .message.content
    )
    assert seeded(5) == seeded(5)
    three = openai_client.chat.completions.create(
        model="default", messages=story, n=3, max_tokens=8, seed=1
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    one = openai_client.chat.completions.create(model="default", messages=story, max_tokens=1)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    lp = openai_client.chat.completions.create(
        model="default", messages=FRANCE, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


def test_stop_string_stops_and_is_not_emitted(openai_client):
    full = (
        openai_client.chat.completions.create(model="default", messages=FRANCE, temperature=0)
        .choices[0]
        .message.content
    )
    cut = openai_client.chat.completions.create(
        model="default", messages=FRANCE, temperature=0, stop=["of Fr"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index("of Fr")]


def test_redis_shows_the_running_job_and_nothing_pending_after(clean_smol, openai_client):
    r = clean_smol.client()
    stream = clean_smol.keys.jobs(MODEL_ID)
    chunks = openai_client.chat.completions.create(
        model="default",
        messages=FRANCE,
        stream=True,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    next(iter(chunks))
    assert r.xlen(stream) == 1
    assert r.xpending(stream, CONSUMER_GROUP)["pending"] == 1
    assert r.hget(clean_smol.keys.node("node-a"), "models")
    for _ in chunks:
        pass
    clean_smol.assert_clean()


def test_client_that_leaves_frees_its_slot(clean_smol, openai_client):
    r = clean_smol.client()
    chunks = openai_client.chat.completions.create(
        model="default",
        messages=FRANCE,
        stream=True,
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(chunks):
        if i == 3:
            break
    chunks.close()
    grace_s = GatewaySettings.model_fields[
        "disconnect_grace_s"
    ].default  # a client may come back to resume it
    clean_smol.assert_clean(timeout_s=grace_s + 10)

    def slots_used() -> int:
        return json.loads(r.hget(clean_smol.keys.node("node-a"), "models"))[MODEL_ID]["slots_used"]

    from tests.stack import wait_for

    wait_for(lambda: slots_used() == 0, 10, "the slot to be freed")
