"""Resuming streams on one gateway (fakeredis, a scripted node that keeps the event log as a node
does): every dialect from any frame, with `starting_after` or `Last-Event-ID`; a job still running;
the grace a reconnect keeps a job alive in; keys; background responses polled and cancelled.
Two replicas, real nodes and the SDKs: tests/integration/resume."""

import asyncio
import json

import pytest

from shared.api_keys import KeySpec
from shared.settings import GatewaySettings
from tests.conftest import eventually
from tests.unit.gateway.conftest import KEYS, WAIT_FOR_CANCEL, delta, done
from tests.unit.gateway.http.routes.test_chat import HELLO, _call_then_disconnect, sse_payloads
from tests.unit.gateway.http.routes.test_messages import sse_events
from tests.unit.gateway.http.routes.test_responses import WEATHER

ADMIN = "admin-secret"


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(
        redis_url="redis://fake",
        request_timeout_s=5.0,
        admin_key=ADMIN,
        disconnect_grace_s=0.3,
        janitor_interval_s=0.05,
    )


def story(entry) -> list:
    return [
        delta("Once"),
        delta(" upon"),
        delta(" a"),
        delta(" time", finish_reason="stop"),
        done(),
    ]


async def test_a_chat_stream_resumed_after_any_frame_gives_the_rest_exactly(client, node):
    node.script = story
    first = await client.post("/v1/chat/completions", json=HELLO | {"stream": True})
    whole = sse_payloads(first.text)
    completion_id = whole[0]["id"]
    for seen in range(len(whole) - 1):  # every frame but [DONE] is numbered
        again = await client.get(
            f"/v1/chat/completions/{completion_id}",
            params={"stream": "true", "starting_after": seen},
        )
        assert again.status_code == 200 and again.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert sse_payloads(again.text, first_id=seen + 1) == whole[seen + 1 :]
    by_header = await client.get(
        f"/v1/chat/completions/{completion_id}?stream=true", headers={"last-event-id": "2"}
    )
    assert sse_payloads(by_header.text, first_id=3) == whole[3:]
    assert (
        sse_payloads((await client.get(f"/v1/chat/completions/{completion_id}?stream=true")).text)
        == whole
    )


async def test_messages_and_completions_resume_too(client, node):
    node.script = story
    first = sse_events(
        (
            await client.post(
                "/v1/messages",
                json={
                    "model": "default",
                    "max_tokens": 8,
                    "stream": True,
                    "messages": HELLO["messages"],
                },
            )
        ).text
    )
    message_id = first[0][1]["message"]["id"]
    numbered = [e for e in first if e[0] != "ping"]
    again = sse_events(
        (await client.get(f"/v1/messages/{message_id}?stream=true&starting_after=3")).text,
        first_id=4,
    )
    assert [e for e in again if e[0] != "ping"] == numbered[4:]

    whole = sse_payloads(
        (
            await client.post(
                "/v1/completions",
                json={"model": "default", "prompt": "x", "echo": True, "stream": True},
            )
        ).text
    )
    again = await client.get(
        f"/v1/completions/{whole[0]['id']}", params={"stream": "true", "starting_after": 1}
    )
    assert sse_payloads(again.text, first_id=2) == whole[2:]
    assert (
        "".join(c["choices"][0]["text"] for c in whole[:-1] if c["choices"]) == "xOnce upon a time"
    )


async def test_tool_calls_are_named_alike_when_a_stream_is_rendered_again(client, node):
    node.script = lambda entry: [
        delta('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        delta("</tool_call>", finish_reason="stop"),
        done(),
    ]
    request = {"model": "default", "input": "Weather?", "tools": [WEATHER], "stream": True}
    first = await client.post("/v1/responses", json=request)
    events = [json.loads(line[6:]) for line in first.text.splitlines() if line.startswith("data: ")]
    ids = [int(line[4:]) for line in first.text.splitlines() if line.startswith("id: ")]
    assert ids == [e["sequence_number"] for e in events] == list(range(len(events)))
    response_id = events[0]["response"]["id"]
    again = await client.get(
        f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 2}
    )
    assert [
        json.loads(line[6:]) for line in again.text.splitlines() if line.startswith("data: ")
    ] == events[3:]
    call = next(e["item"] for e in events if e["type"] == "response.output_item.added")
    assert call["type"] == "function_call" and call["call_id"].startswith("call_")


async def test_a_running_job_is_resumed_from_its_log_then_live(app, client, node):
    gate = asyncio.Event()
    node.script = lambda entry: [
        delta("Once"),
        delta(" upon"),
        gate,
        delta(" a"),
        delta(" time"),
        done(),
    ]
    sent = await _call_then_disconnect(app, HELLO | {"stream": True}, after=b'" upon"')
    seen = sse_payloads(b"".join(m.get("body", b"") for m in sent).decode())
    resumed = asyncio.create_task(
        client.get(
            f"/v1/chat/completions/{seen[0]['id']}?stream=true",
            headers={"last-event-id": str(len(seen) - 1)},
        )
    )
    await asyncio.sleep(0.5)  # longer than the grace: the resumed reader keeps the job
    assert node.cancelled == []
    gate.set()
    rest = sse_payloads((await resumed).text, first_id=len(seen))
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in seen + rest[:-1] if c["choices"]
    )
    assert text == "Once upon a time" and rest[-1] == "[DONE]"


async def test_a_client_that_leaves_again_after_resuming_gets_a_grace_of_its_own(app, client, node):
    node.script = lambda entry: [delta("Once"), WAIT_FOR_CANCEL]
    sent = await _call_then_disconnect(app, HELLO | {"stream": True}, after=b'"Once"')
    job = node.entries[0].job
    await asyncio.sleep(0.2)
    resumed = asyncio.create_task(client.get(f"/v1/chat/completions/chatcmpl-{job}?stream=true"))
    await asyncio.sleep(0.05)
    resumed.cancel()  # the resumed client goes away too, 0.25 s after the first
    await asyncio.gather(resumed, return_exceptions=True)
    await asyncio.sleep(0.15)  # the first departure's grace is over; the second's is not
    assert node.cancelled == [] and sent[0]["status"] == 200
    await eventually(lambda: node.cancelled == [job], 2, "the job cancelled after the second grace")


async def test_with_x_cortex_background_a_stream_runs_on_without_its_client(app, node):
    node.script = lambda entry: [delta("Once"), WAIT_FOR_CANCEL]
    scope_headers = [(b"content-type", b"application/json"), (b"x-cortex-background", b"true")]
    await _call_then_disconnect(
        app, HELLO | {"stream": True}, after=b'"Once"', headers=scope_headers
    )
    await asyncio.sleep(0.5)
    assert node.cancelled == []


async def test_resume_is_for_the_same_key_and_the_same_endpoint(app, client, node):
    node.script = story
    alice = (await app.state.ctx.api_keys.create(KeySpec(name="alice")))[1]
    bob = (await app.state.ctx.api_keys.create(KeySpec(name="bob")))[1]
    first = sse_payloads(
        (
            await client.post(
                "/v1/chat/completions",
                json=HELLO | {"stream": True},
                headers={"authorization": f"Bearer {alice}"},
            )
        ).text
    )
    job_id = first[0]["id"]
    as_bob = await client.get(
        f"/v1/chat/completions/{job_id}?stream=true", headers={"authorization": f"Bearer {bob}"}
    )
    assert as_bob.status_code == 404 and as_bob.json()["error"]["code"] == "not_found"
    as_message = await client.get(
        f"/v1/messages/msg_{job_id.removeprefix('chatcmpl-')}?stream=true",
        headers={"x-api-key": alice},
    )
    assert as_message.status_code == 404 and as_message.json()["type"] == "error"
    unstreamed = await client.get(
        f"/v1/chat/completions/{job_id}", headers={"authorization": f"Bearer {alice}"}
    )
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream"
    bad_header = await client.get(
        f"/v1/chat/completions/{job_id}?stream=true",
        headers={"authorization": f"Bearer {alice}", "last-event-id": "x"},
    )
    assert bad_header.status_code == 400 and bad_header.json()["error"]["param"] == "Last-Event-ID"
    key = await app.state.ctx.api_keys.get("alice")
    again = await client.get(
        f"/v1/chat/completions/{job_id}?stream=true", headers={"authorization": f"Bearer {alice}"}
    )
    assert sse_payloads(again.text) == first
    assert (
        (await app.state.ctx.api_keys.get("alice")).completion_tokens == key.completion_tokens == 3
    )  # counted once


async def test_a_background_response_is_polled_to_its_end_and_stored(app, client, node, redis):
    gate = asyncio.Event()
    node.script = lambda entry: [gate, delta("Once"), delta(" upon", finish_reason="stop"), done()]
    created = await client.post(
        "/v1/responses", json={"model": "default", "input": "Tell", "background": True}
    )
    assert created.status_code == 200
    body = created.json()
    assert (body["status"], body["background"], body["output"]) == ("queued", True, [])
    polled = (await client.get(f"/v1/responses/{body['id']}")).json()
    assert polled["status"] in ("queued", "in_progress") and polled["output"] == []
    gate.set()
    for _ in range(100):
        polled = (await client.get(f"/v1/responses/{body['id']}")).json()
        if polled["status"] == "completed":
            break
        await asyncio.sleep(0.02)
    assert (
        polled["output"][0]["content"][0]["text"] == "Once upon"
        and polled["usage"]["output_tokens"] == 3
    )
    stored = json.loads(await redis.get(KEYS.response(body["id"])))
    assert "pending" not in stored and stored["conversation"][-1] == {
        "role": "assistant",
        "content": "Once upon",
    }
    assert await redis.zcard(KEYS.background_responses()) == 0
    follow = await client.post(
        "/v1/responses",
        json={"model": "default", "input": "More", "previous_response_id": body["id"]},
    )
    assert follow.status_code == 200
    assert node.entries[-1].request().messages[-2] == {"role": "assistant", "content": "Once upon"}


async def test_the_janitor_stores_a_background_response_nobody_polls(client, node, redis):
    node.script = story
    body = (
        await client.post(
            "/v1/responses", json={"model": "default", "input": "Tell", "background": True}
        )
    ).json()
    for _ in range(100):
        if not await redis.zcard(KEYS.background_responses()):
            break
        await asyncio.sleep(0.05)
    stored = json.loads(await redis.get(KEYS.response(body["id"])))
    assert stored["response"]["status"] == "completed" and "pending" not in stored


async def test_a_background_response_is_cancelled(client, node):
    node.script = lambda entry: [delta("Once"), WAIT_FOR_CANCEL]
    body = (
        await client.post(
            "/v1/responses", json={"model": "default", "input": "Tell", "background": True}
        )
    ).json()

    async def answering() -> bool:
        return (await client.get(f"/v1/responses/{body['id']}")).json()["output"] != []

    await eventually(answering, 2, "the response's first words")
    cancelled = await client.post(f"/v1/responses/{body['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["output"][0]["content"][0]["text"] == "Once"
    await eventually(lambda: node.cancelled == [node.entries[0].job], 2, "the job cancelled")
    assert (await client.get(f"/v1/responses/{body['id']}")).json()["status"] == "cancelled"
    again = await client.post(f"/v1/responses/{body['id']}/cancel")
    assert again.json()["status"] == "cancelled"
    node.script = story
    plain = (await client.post("/v1/responses", json={"model": "default", "input": "x"})).json()
    refused = await client.post(f"/v1/responses/{plain['id']}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
