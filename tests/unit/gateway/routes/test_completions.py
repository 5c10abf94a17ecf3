"""POST /v1/completions against a scripted node."""

from shared.wire import TokenLogprob, TopLogprob
from tests.unit.gateway.conftest import MODEL, delta, done
from tests.unit.gateway.routes.test_chat import sse_payloads

PROMPT = {"model": "default", "prompt": "Once upon"}


def _logprob(token: str) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=-0.5, bytes=list(token.encode()),
                        top_logprobs=[TopLogprob(token=token, logprob=-0.5, bytes=list(token.encode()))])


async def test_non_stream(client, node):
    body = (await client.post("/v1/completions", json=PROMPT)).json()
    [entry] = node.entries
    assert entry.kind == "completion" and entry.request().prompt == "Once upon"
    assert body["id"] == f"cmpl-{entry.job}" and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "Hello!", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def test_token_prompt(client, node):
    await client.post("/v1/completions", json=PROMPT | {"prompt": [1, 2, 3]})
    assert node.entries[0].request().prompt == [1, 2, 3]


async def test_stream(client, node):
    request = PROMPT | {"stream": True, "stream_options": {"include_usage": True}}
    *chunks, last = sse_payloads((await client.post("/v1/completions", json=request)).text)
    assert last == "[DONE]"
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == [
        ("Hel", None), ("lo", None), ("!", "stop"),
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8


async def test_legacy_logprobs(client, node):
    node.script = lambda entry: [
        delta("Hel", logprobs=[_logprob("Hel")]), delta("lo", logprobs=[_logprob("lo")], finish_reason="length"), done(),
    ]
    body = (await client.post("/v1/completions", json=PROMPT | {"logprobs": 1})).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"Hel": -0.5}, {"lo": -0.5}], "text_offset": [0, 3],
    }
    chunks = sse_payloads((await client.post("/v1/completions", json=PROMPT | {"logprobs": 1, "stream": True})).text)
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:-1]] == [[0], [3]]


async def test_batch_of_prompts_is_a_clear_400(client, node):
    response = await client.post("/v1/completions", json=PROMPT | {"prompt": ["a", "b"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and "batches of prompts are not supported" in error["message"]
