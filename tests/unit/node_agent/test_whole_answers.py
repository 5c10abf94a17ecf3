"""A job whose client does not stream gets its tokens joined (NodeSettings.whole_flush_s): one delta
at most every `whole_flush_s` and one with its end, not an event a token; a streamed job beside it
still gets each token as it comes. What each client reads in the end is the same text and ids.
Against a real redis-server, through the output process's side (`OutputSide`) and the publisher."""

import shutil

import pytest
import redis.asyncio as aioredis

from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.output import OutputProcessor
from node_agent.engine.records import JobOpened, StepOutput, TokenOut
from node_agent.serving.output_messages import Delivery, Outgoing, Publish
from node_agent.serving.output_process import OutputSide
from node_agent.serving.publisher import Publisher
from shared import event_log
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_conn import connect
from shared.wire import DeltaEvent, DoneEvent, ErrorEvent, unpack_event
from tests.unit.node_agent.test_usage_charge import Letters

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
KEYS = Keys()
STREAM = KEYS.jobs("m")
JOBS = {"whole": False, "streamed": True, "failing": False}  # job -> its client streams it


async def heard(pubsub, until: int) -> dict[str, list]:
    """Events per job, until `until` have come."""
    got: dict[str, list] = {job: [] for job in JOBS}
    for _ in range(until):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None, got
        got[message["channel"].decode().split(":")[-1]].append(unpack_event(message["data"]))
    return got


async def test_a_job_not_streamed_gets_its_tokens_joined_a_streamed_one_each(redis_url):
    admin = aioredis.Redis.from_url(redis_url)
    await admin.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    entries = {job: (await admin.xadd(STREAM, {"job": job})).decode() for job in JOBS}
    await admin.xreadgroup(CONSUMER_GROUP, "node-a", {STREAM: ">"})
    for job in JOBS:  # each has its log, as the gateway makes it
        await admin.xadd(KEYS.event_log(job), {event_log.RECORD: b"{}"})
    pubsub = admin.pubsub()
    await pubsub.subscribe(*(f"events:{job}" for job in JOBS))
    for _ in JOBS:  # each subscription's confirmation
        await pubsub.get_message(timeout=1)
    publisher = Publisher(connect(redis_url), KEYS, "node-a", on_unheard=lambda job: None)
    publisher.start()
    now = [0.0]
    side = OutputSide(
        OutputProcessor(TokenizerText(None, other=Letters()), "node-a"),
        publisher,
        lambda _: None,
        whole_flush_s=1.0,
        clock=lambda: now[0],
    )
    side.publish(
        Publish(
            items=[],
            deliveries=[
                Delivery(job, f"events:{job}", STREAM, entries[job], streaming=streams)
                for job, streams in JOBS.items()
            ],
        )
    )
    opened = [
        JobOpened(job, [key], prompt_tokens=3, submitted_ms=0) for key, job in enumerate(JOBS)
    ]

    def step(token: int, finish: str | None = None, opened: list = []) -> None:
        side.step(
            StepOutput(
                time_ms=token + 1,
                started_ms=token,
                opened=opened,
                tokens=[TokenOut(key, token, finish=finish) for key in range(2)]
                + ([TokenOut(2, token)] if token < 5 else []),  # the failing one ends before
            )
        )

    step(0, opened=opened)
    for token in (1, 2):
        now[0] += 0.3
        step(token)
    await publisher.flush()
    got = await heard(pubsub, 3)  # the streamed job's three tokens; nothing of the others yet
    assert [e.choices[0].text for e in got["streamed"]] == ["a", "b", "c"]
    assert got["whole"] == got["failing"] == []

    now[0] += 0.5  # 1.1 s since the first token held back: what is held goes, joined
    step(3)
    await publisher.flush()
    got = await heard(pubsub, 3)
    (joined,) = got["whole"]
    assert [(c.text, c.token_ids) for c in joined.choices] == [("abcd", [0, 1, 2, 3])]
    (failing,) = got["failing"]
    assert failing.choices[0].text == "abcd"

    step(4)  # held again, then ended by the engine: one delta with the end, and the done event
    side.publish(  # the node ends the failing one: what it held goes first
        Publish(
            items=[
                Outgoing(
                    "events:failing",
                    [ErrorEvent(code="generation_failed", message="the device faulted")],
                    (STREAM, entries["failing"]),
                    job="failing",
                )
            ]
        )
    )
    step(5, finish="length")
    await publisher.flush()
    got = await heard(pubsub, 2 + 2 + 2)
    assert [type(e) for e in got["failing"]] == [DeltaEvent, ErrorEvent]
    assert got["failing"][0].choices[0].text == "e"
    assert [type(e) for e in got["whole"]] == [DeltaEvent, DoneEvent]
    assert got["whole"][0].choices[0].text == "ef"
    assert got["whole"][0].choices[0].finish_reason == "length"
    assert [e.choices[0].text for e in got["streamed"]] == ["e", "f"]
    assert not side._held and not side.deliveries

    def logged(job: str) -> list:
        return [event for _, fields in entries_of[job] for event in event_log.events(fields)]

    entries_of = {job: await admin.xrange(KEYS.event_log(job)) for job in JOBS}
    texts = {
        job: "".join(e.choices[0].text for e in logged(job) if isinstance(e, DeltaEvent))
        for job in JOBS
    }
    assert texts == {"whole": "abcdef", "streamed": "abcdef", "failing": "abcde"}
    assert len(entries_of["whole"]) == 1 + 2  # the record, then two round trips' entries
    assert isinstance(logged("failing")[-1], ErrorEvent)
    assert (await admin.xpending(STREAM, CONSUMER_GROUP))["pending"] == 0
    await publisher.stop()
    await pubsub.aclose()
    await admin.aclose()
