"""Streams that survive a dropped connection, end to end: a client drops half-way through and
resumes through the other replica; the same after SIGKILL of the replica it read from; background
responses with the real openai SDK (fetched, streamed from the start and from the middle,
cancelled); event logs kept alive while their job runs and gone once the retention has passed."""

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from shared import event_log
from tests.integration.resume.conftest import RETENTION_S
from tests.stack import wait_for

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
CHAT = {
    "model": "tiny",
    "messages": PROMPT,
    "temperature": 0,
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def frames(lines: Iterator[str]) -> Iterator[tuple[int | None, str]]:
    """(id, data) of each SSE frame with data, as the lines of a response come."""
    frame_id = None
    for line in lines:
        if line.startswith("id: "):
            frame_id = int(line[4:])
        elif line.startswith("data: "):
            yield frame_id, line[6:]
            frame_id = None


def chat_text(datas: list[str]) -> str:
    chunks = [json.loads(d) for d in datas if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def whole_chat(url: str) -> tuple[list[int], list[str]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=CHAT, timeout=120) as response:
        got = list(frames(response.iter_lines()))
    return [i for i, _ in got if i is not None], [d for _, d in got]


def read_part(lines: Iterator[str], count: int) -> tuple[str, list[int], list[str]]:
    """The next `count` numbered frames of a chat stream: (completion id, ids, datas)."""
    ids, datas = [], []
    for frame_id, data in frames(lines):
        ids.append(frame_id)
        datas.append(data)
        if len(ids) == count:
            break
    return json.loads(datas[0])["id"], ids, datas


def resume_chat(url: str, completion_id: str, last_id: int) -> tuple[list[int], list[str]]:
    with httpx.stream(
        "GET",
        f"{url}/v1/chat/completions/{completion_id}",
        params={"stream": "true"},
        headers={"Last-Event-ID": str(last_id)},
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        got = list(frames(response.iter_lines()))
    return [i for i, _ in got if i is not None], [d for _, d in got]


def test_a_client_that_drops_half_way_resumes_through_the_other_replica(stack):
    first, second = stack.replicas
    whole_ids, whole = whole_chat(second)  # the uninterrupted run, greedy
    assert whole_ids == list(range(len(whole_ids))) and len(whole_ids) > 300
    with httpx.stream("POST", f"{first}/v1/chat/completions", json=CHAT, timeout=120) as response:
        completion_id, ids, part = read_part(response.iter_lines(), 150)
    rest_ids, rest = resume_chat(second, completion_id, ids[-1])
    assert ids + rest_ids == whole_ids  # every frame once, in order
    assert chat_text(part + rest) == chat_text(whole) and len(chat_text(whole)) > 400
    assert rest[-1] == "[DONE]"


def test_a_replica_killed_mid_stream_loses_nothing(stack):
    first, second = stack.replicas
    _, whole = whole_chat(second)
    stack.start_gateway()  # a third replica, to kill
    victim = stack.services[-1]
    with httpx.stream(
        "POST", f"{stack.gateway_url}/v1/chat/completions", json=CHAT, timeout=120
    ) as response:
        lines = response.iter_lines()
        completion_id, ids, part = read_part(lines, 100)
        victim.proc.kill()  # SIGKILL: its timers and subscriptions die with it
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    rest_ids, rest = resume_chat(first, completion_id, ids[-1])
    assert rest_ids[0] == ids[-1] + 1 and rest[-1] == "[DONE]"
    assert chat_text(part + rest) == chat_text(whole)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_background_response_completes_with_no_client_and_is_fetched_and_streamed_again(stack):
    first, second = stack.replicas
    created = sdk(first).responses.create(
        model="tiny",
        input="Tell me a story.",
        background=True,
        max_output_tokens=300,
        temperature=0,
    )
    assert created.status == "queued" and created.background
    wait_for(
        lambda: sdk(second).responses.retrieve(created.id).status not in ("queued", "in_progress"),
        60,
        "the background response",
    )
    done = sdk(second).responses.retrieve(created.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"

    # streamed again at once: its events are kept `stream_retention_s` (3 s here) after it ended
    events = list(sdk(first).responses.retrieve(created.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == done.output_text
    )
    middle = len(events) // 2
    rest = list(sdk(second).responses.retrieve(created.id, stream=True, starting_after=middle))
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[middle + 1 :]]

    reference = sdk(second).responses.create(
        model="tiny", input="Tell me a story.", max_output_tokens=300, temperature=0
    )
    assert (
        done.output_text == reference.output_text
        and done.usage.output_tokens == reference.usage.output_tokens
    )


def slots_used(stack) -> int:
    return stack.models_on("node-r")["tiny"]["slots_used"]


def test_cancel_stops_a_background_response_and_frees_its_slot(stack):
    client = sdk(stack.replicas[0])
    created = client.responses.create(
        model="tiny",
        input="Tell me a story.",
        background=True,
        max_output_tokens=4000,
        temperature=0,
    )
    wait_for(
        lambda: client.responses.retrieve(created.id).status == "in_progress",
        60,
        "the job to start",
    )
    wait_for(lambda: slots_used(stack) == 1, 10, "the heartbeat to count the job")
    cancelled = sdk(stack.replicas[1]).responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: slots_used(stack) == 0, 10, "its slot to be freed")
    after = client.responses.retrieve(created.id)
    assert after.status == "cancelled" and after.usage is None
    log = stack.client().xrange(stack.keys.event_log(created.id.removeprefix("resp_")))
    last = event_log.events(log[-1][1])[-1]
    assert (last.type, last.code) == ("error", "cancelled")  # the node stopped it
    assert sum(len(event_log.events(fields)) for _, fields in log) < 4000


def test_an_event_log_lives_while_its_job_runs_and_is_gone_after_the_retention(stack):
    r = stack.client()
    with httpx.stream(
        "POST",
        f"{stack.replicas[0]}/v1/chat/completions",
        timeout=120,
        json=CHAT | {"max_tokens": 4000},
    ) as response:
        lines = response.iter_lines()
        completion_id, _, _ = read_part(lines, 1)
        log_key = stack.keys.event_log(completion_id.removeprefix("chatcmpl-"))
        started, ttls = time.monotonic(), []
        for _ in lines:
            if time.monotonic() - started > len(ttls) * 0.2:
                ttls.append(r.ttl(log_key))
    ran_s = time.monotonic() - started
    assert ran_s > RETENTION_S, (
        f"the job ran {ran_s:.1f}s: too short to see the node renew its log's expiry"
    )
    assert all(0 < ttl <= 1200 for ttl in ttls), (
        ttls
    )  # never without an expiry, never gone while it ran
    assert 0 < r.ttl(log_key) <= RETENTION_S
    assert r.xlen(log_key) == 1 + 1 + 4000  # the record, the start event, one entry per step
    wait_for(lambda: not r.exists(log_key), RETENTION_S + 2, "the event log to expire")
