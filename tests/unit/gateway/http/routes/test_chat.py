"""POST /v1/chat/completions against a scripted node: stream and non-stream, errors, cancel."""

import asyncio
import json

import pytest

from shared.wire import ErrorEvent, StartEvent, TokenLogprob, TopLogprob
from tests.conftest import eventually
from tests.unit.gateway.conftest import KEYS, MODEL, WAIT_FOR_CANCEL, delta, done

HELLO = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


def sse_payloads(text: str, first_id: int = 0) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except `[DONE]`; the frames that carry an
    `id:` (all but `[DONE]` and a final error) are numbered on from `first_id`."""
    payloads, ids = [], []
    for frame in filter(None, text.split("\n\n")):
        lines = frame.split("\n")
        if lines[0].startswith("id: "):
            ids.append(int(lines.pop(0)[4:]))
        assert len(lines) == 1 and lines[0].startswith("data: "), frame
        payloads.append(lines[0][6:] if lines[0] == "data: [DONE]" else json.loads(lines[0][6:]))
    assert ids == list(range(first_id, first_id + len(ids)))
    assert len(ids) >= len(payloads) - 2  # only [DONE] and an error frame go unnumbered
    return payloads


async def test_non_stream_answer(client, node):
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 200, response.text
    body = response.json()
    job = node.entries[0].job
    assert body["id"] == f"chatcmpl-{job}"
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL  # the alias resolved to the catalogue id
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stream_chunk_order(client, node):
    request = HELLO | {"stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    *chunks, last = sse_payloads(response.text)
    assert last == "[DONE]"
    job = node.entries[0].job
    assert {c["id"] for c in chunks} == {f"chatcmpl-{job}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {"content": "!"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [
        None,
        None,
        None,
        None,
        "stop",
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stream_without_usage_has_no_usage_chunk(client, node):
    response = await client.post("/v1/chat/completions", json=HELLO | {"stream": True})
    *chunks, last = sse_payloads(response.text)
    assert last == "[DONE]"
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_job_entry_and_subscription_before_enqueue(client, node):
    request = HELLO | {"max_tokens": 7, "temperature": 0, "stop": "x", "seed": 3, "top_k": 5}
    await client.post("/v1/chat/completions", json=request)
    [entry] = node.entries
    assert node.subscribers_at_read == [1]  # the gateway listened before the job was visible
    assert entry.kind == "chat" and entry.model == MODEL and entry.max_tokens == 7
    assert entry.job_class == "interactive" and entry.channel == KEYS.events(entry.job)
    generation = entry.request()
    assert generation.messages == [{"role": "user", "content": "hi"}]
    assert (generation.sampling.temperature, generation.sampling.stop) == (0.0, ["x"])
    assert (generation.sampling.seed, generation.sampling.top_k) == (3, 5)


async def test_no_keys_left_but_the_job_stream_the_routing_counts_and_the_streamed_jobs_event_log(
    client, node, redis
):
    before = set(await redis.keys("*"))
    await client.post("/v1/chat/completions", json=HELLO)
    await client.post("/v1/chat/completions", json=HELLO | {"stream": True})
    streamed = KEYS.event_log(node.entries[1].job)
    assert set(await redis.keys("*")) - before == {
        KEYS.jobs(MODEL).encode(),
        streamed.encode(),
        KEYS.routing(MODEL).encode(),
    }
    assert await redis.hgetall(KEYS.routing(MODEL)) == {
        b"shared": b"2"
    }  # one fake node: nothing to route by
    assert (
        0 < await redis.ttl(streamed) <= 600 + 5
    )  # stream_retention_s + request_timeout_s: a node renews it
    assert await redis.pubsub_channels() == [KEYS.cancel().encode()]  # only the node's own
    assert node.cancelled == []


async def test_n_choices_and_logprobs(client, node):
    top = TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])
    logprob = TokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=[top])
    node.script = lambda entry: [
        delta("Hi", 0, logprobs=[logprob]),
        delta("Yo", 1, logprobs=[logprob], finish_reason="length"),
        delta("", 0, finish_reason="stop"),
        done(),
    ]
    request = HELLO | {"n": 2, "logprobs": True, "top_logprobs": 1}
    body = (await client.post("/v1/chat/completions", json=request)).json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hi", "stop"),
        (1, "Yo", "length"),
    ]
    expected = {
        "token": "Hi",
        "logprob": -0.1,
        "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
    }
    assert body["choices"][0]["logprobs"]["content"] == [expected]

    chunks = sse_payloads(
        (await client.post("/v1/chat/completions", json=request | {"stream": True})).text
    )[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "stop", 1: "length"}
    assert chunks[2]["choices"][0]["logprobs"]["content"] == [expected]


async def test_error_event_before_output_is_an_http_error(client, node):
    node.script = lambda entry: [
        ErrorEvent(code="context_length_exceeded", message="prompt is 9000 tokens")
    ]
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json=HELLO | {"stream": stream})
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "prompt is 9000 tokens",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    assert node.cancelled == []  # the node ended those jobs itself


async def test_error_event_mid_stream_ends_the_stream_cleanly(client, node):
    node.script = lambda entry: [
        delta("Hel"),
        ErrorEvent(code="node_lost", message="node n1 went away"),
    ]
    response = await client.post("/v1/chat/completions", json=HELLO | {"stream": True})
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-2] == {
        "error": {
            "message": "node n1 went away",
            "type": "service_unavailable",
            "param": None,
            "code": "node_lost",
        }
    }
    assert payloads[-1] == "[DONE]"
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 503 and response.json()["error"]["code"] == "node_lost"


async def test_a_job_run_again_after_its_node_was_lost_answers_once(client, node):
    """Not streamed, it is requeued by the janitor when its node dies mid-answer and runs again from
    its start on another node: the answer is the second run's, not the first's partial text + it."""
    start = StartEvent(prompt_tokens=5)
    node.script = lambda entry: [
        start,
        delta("Once upon"),
        start,
        delta("Once upon"),
        delta(" a time", finish_reason="stop"),
        done(),
    ]
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.json()["choices"][0]["message"]["content"] == "Once upon a time"
    completion = await client.post(
        "/v1/completions", json={"model": HELLO["model"], "prompt": "Hi"}
    )
    assert completion.json()["choices"][0]["text"] == "Once upon a time"


async def test_timeout_is_504_and_cancels(client, node, app):
    app.state.ctx.settings.request_timeout_s = 0.2
    node.script = lambda entry: [WAIT_FOR_CANCEL]
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    await eventually(lambda: node.cancelled == [node.entries[0].job], 2, "the job cancelled")


def _http_scope(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers or [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5555),
        "server": ("gateway", 80),
    }


async def _call_then_disconnect(
    app, body: dict, *, after: bytes | None, headers: list[tuple[bytes, bytes]] | None = None
) -> list[dict]:
    """Drive the ASGI app directly; the client disconnects once a body part contains `after`
    (or, with `after=None`, right after sending the request)."""
    gone = asyncio.Event()
    requests = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent = []

    async def receive() -> dict:
        if requests:
            return requests.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if after is not None and after in message.get("body", b""):
            gone.set()

    if after is None:
        asyncio.get_running_loop().call_later(0.1, gone.set)
    async with asyncio.timeout(5):
        await app(_http_scope("/v1/chat/completions", headers), receive, send)
    return sent


async def test_a_streamed_job_whose_client_went_away_is_cancelled_after_the_grace(app, node, redis):
    app.state.ctx.settings.disconnect_grace_s = 0.3
    node.script = lambda entry: [delta("Hel"), delta("lo"), WAIT_FOR_CANCEL]
    sent = await _call_then_disconnect(app, HELLO | {"stream": True}, after=b'"lo"')
    assert sent[0]["status"] == 200
    await asyncio.sleep(0.1)
    assert node.cancelled == []  # the client may come back
    assert await redis.pubsub_numsub(node.entries[0].channel) == [
        (node.entries[0].channel.encode(), 0)
    ]
    await eventually(
        lambda: node.cancelled == [node.entries[0].job], 2, "the job cancelled after the grace"
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_cancel_published_when_waiting_client_goes_away(app, node, stream):
    app.state.ctx.settings.disconnect_grace_s = 0
    node.script = lambda entry: [WAIT_FOR_CANCEL]  # no output yet: the model is still loading, say
    await _call_then_disconnect(app, HELLO | {"stream": stream}, after=None)
    await eventually(lambda: node.cancelled == [node.entries[0].job], 2, "the job cancelled")


async def test_concurrent_streams_share_one_router(client, node, app):
    responses = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=HELLO | {"stream": True}) for _ in range(8))
    )
    assert all(sse_payloads(r.text)[-1] == "[DONE]" for r in responses)
    assert len({e.job for e in node.entries}) == 8
    assert app.state.ctx.bus.in_flight == 0


async def test_prompt_tokens_read_from_the_prefix_cache_are_reported(client, node):
    node.script = lambda entry: [
        delta("Hi", 0, finish_reason="stop"),
        done(prompt_tokens=40, cached_tokens=32),
    ]
    body = (await client.post("/v1/chat/completions", json=HELLO)).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    responses = (
        await client.post("/v1/responses", json={"model": "default", "input": "hi"})
    ).json()
    assert responses["usage"]["input_tokens_details"] == {"cached_tokens": 32}
