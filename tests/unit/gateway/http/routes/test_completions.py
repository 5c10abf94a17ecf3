"""POST /v1/completions against a scripted node."""

from shared.wire import PromptLogprob, StartEvent, TokenLogprob, TopLogprob
from tests.unit.gateway.conftest import MODEL, delta, done
from tests.unit.gateway.http.routes.test_chat import sse_payloads

PROMPT = {"model": "default", "prompt": "Once upon"}


def _logprob(token: str) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=-0.5,
        bytes=list(token.encode()),
        top_logprobs=[TopLogprob(token=token, logprob=-0.5, bytes=list(token.encode()))],
    )


async def test_non_stream(client, node):
    body = (await client.post("/v1/completions", json=PROMPT)).json()
    [entry] = node.entries
    assert entry.kind == "completion" and entry.request().prompt == "Once upon"
    assert (
        body["id"] == f"cmpl-{entry.job}"
        and body["object"] == "text_completion"
        and body["model"] == MODEL
    )
    assert body["choices"] == [
        {"index": 0, "text": "Hello!", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_token_prompt(client, node):
    await client.post("/v1/completions", json=PROMPT | {"prompt": [1, 2, 3]})
    assert node.entries[0].request().prompt == [1, 2, 3]


async def test_stream(client, node):
    request = PROMPT | {"stream": True, "stream_options": {"include_usage": True}}
    *chunks, last = sse_payloads((await client.post("/v1/completions", json=request)).text)
    assert last == "[DONE]"
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == [
        ("Hel", None),
        ("lo", None),
        ("!", "stop"),
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8


async def test_legacy_logprobs(client, node):
    node.script = lambda entry: [
        delta("Hel", logprobs=[_logprob("Hel")]),
        delta("lo", logprobs=[_logprob("lo")], finish_reason="length"),
        done(),
    ]
    body = (await client.post("/v1/completions", json=PROMPT | {"logprobs": 1})).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"Hel": -0.5}, {"lo": -0.5}],
        "text_offset": [0, 3],
    }
    chunks = sse_payloads(
        (await client.post("/v1/completions", json=PROMPT | {"logprobs": 1, "stream": True})).text
    )
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:-1]] == [[0], [3]]


async def test_batch_of_prompts_is_a_clear_400(client, node):
    response = await client.post("/v1/completions", json=PROMPT | {"prompt": ["a", "b"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and "batches of prompts are not supported" in error["message"]


async def test_echo_puts_the_prompt_first(client, node):
    whole = (await client.post("/v1/completions", json=PROMPT | {"echo": True})).json()
    assert whole["choices"][0]["text"] == "Once uponHello!"
    chunks = sse_payloads(
        (await client.post("/v1/completions", json=PROMPT | {"echo": True, "stream": True})).text
    )
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Once uponHel", "lo", "!"]
    assert (
        node.entries[0].request().echo
        and node.entries[0].request().sampling.prompt_logprobs is None
    )


async def test_echo_of_token_ids_uses_the_nodes_decoding(client, node):
    node.script = lambda entry: [
        StartEvent(prompt_tokens=3, prompt_text="<s>Once"),
        delta(" upon", finish_reason="stop"),
        done(),
    ]
    body = (
        await client.post("/v1/completions", json=PROMPT | {"prompt": [1, 2, 3], "echo": True})
    ).json()
    assert body["choices"][0]["text"] == "<s>Once upon"


async def test_echo_with_logprobs_carries_the_prompts(client, node):
    first = PromptLogprob(token="Once", logprob=None)
    second = PromptLogprob(
        token=" upon",
        logprob=-2.0,
        top_logprobs=[TopLogprob(token=" upon", logprob=-2.0, bytes=[])],
    )
    node.script = lambda entry: [
        delta("Hel", logprobs=[_logprob("Hel")], prompt_logprobs=[first, second]),
        delta("lo", logprobs=[_logprob("lo")], finish_reason="stop"),
        done(),
    ]
    body = (
        await client.post("/v1/completions", json=PROMPT | {"echo": True, "logprobs": 1})
    ).json()
    assert node.entries[0].request().sampling.prompt_logprobs == 1
    [choice] = body["choices"]
    assert choice["text"] == "Once uponHello"
    assert choice["logprobs"] == {
        "tokens": ["Once", " upon", "Hel", "lo"],
        "token_logprobs": [None, -2.0, -0.5, -0.5],
        "text_offset": [0, 4, 9, 12],
        "top_logprobs": [None, {" upon": -2.0}, {"Hel": -0.5}, {"lo": -0.5}],
    }
