"""Submitting a job: subscribe, XADD, events to the end, cancel and clean-up."""

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.jobs.caller import ANONYMOUS_CALLER
from gateway.jobs.job import OnDisconnect
from gateway.jobs.submit import new_job_id, submit
from shared.errors import BrokerUnavailable, ContextLengthExceeded, Timeout
from shared.keys import CONSUMER_GROUP
from shared.lifecycle import JobState
from shared.wire import ErrorEvent, GenerationRequest, SamplingParams, StreamEntry, pack_event
from tests.unit.gateway.conftest import KEYS, MODEL, delta, done


@pytest.fixture
def ctx(app):
    return app.state.ctx


def request(**sampling) -> GenerationRequest:
    return GenerationRequest(
        job=new_job_id(),
        model=MODEL,
        kind="completion",
        prompt="x",
        sampling=SamplingParams(**sampling),
    )


async def cancels(redis):
    pubsub = redis.pubsub()
    await pubsub.subscribe(KEYS.cancel())
    await pubsub.get_message(timeout=1)  # the subscribe confirmation
    return pubsub


async def test_entry_fields_and_events(ctx, redis):
    job = await submit(ctx, request(max_tokens=9), ANONYMOUS_CALLER, job_class="batch")
    [(entry_id, fields)] = await redis.xrange(
        KEYS.jobs(MODEL, "batch")
    )  # the batch class has its own stream
    assert {k.decode() for k in fields} == {
        "v",
        "job",
        "kind",
        "model",
        "job_class",
        "max_tokens",
        "submitted_ms",
        "channel",
        "request_id",
        "streaming",
        "retries",
        "tenant",
        "body",
    }
    entry = StreamEntry.from_fields(fields)
    assert (entry.job, entry.kind, entry.job_class, entry.max_tokens) == (
        job.id,
        "completion",
        "batch",
        9,
    )
    assert entry.channel == KEYS.events(job.id) and entry.request().prompt == "x"
    await redis.publish(entry.channel, pack_event(delta("a")))
    await redis.publish(entry.channel, pack_event(done()))
    async with job:
        got = [event async for event in job.events()]
    assert [e.type for e in got] == ["delta", "done"] and job.state is JobState.FINISHED
    assert ctx.bus.in_flight == 0


async def node_reads(redis, job) -> None:
    """A node reads the job's entry: it runs it (a close now cancels it there)."""
    await redis.xgroup_create(job.stream, CONSUMER_GROUP, id="0", mkstream=True)
    await redis.xreadgroup(CONSUMER_GROUP, "n1", {job.stream: ">"})


async def test_close_before_done_publishes_cancel(ctx, redis):
    listener = await cancels(redis)
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    await node_reads(redis, job)
    assert job.state is JobState.QUEUED  # no event yet: a node reading it is not news here
    await job.close()
    await job.close()  # idempotent: one cancel
    assert job.state is JobState.CANCELLED
    assert (await listener.get_message(timeout=1))["data"] == job.id.encode()
    assert await listener.get_message(timeout=0.05) is None
    assert ctx.bus.in_flight == 0


async def test_close_before_any_node_read_the_job_withdraws_it(ctx, redis):
    listener = await cancels(redis)
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    await job.close()
    assert job.state is JobState.CANCELLED
    assert await redis.xlen(job.stream) == 0  # no node will run it for nobody
    assert await listener.get_message(timeout=0.05) is None  # and no node is bothered with a cancel


async def test_error_event_raises_the_typed_error_without_cancel(ctx, redis):
    listener = await cancels(redis)
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    await redis.publish(
        KEYS.events(job.id),
        pack_event(ErrorEvent(code="context_length_exceeded", message="too long")),
    )
    with pytest.raises(ContextLengthExceeded, match="too long"):
        async with job:
            async for _ in job.events():
                pass
    assert job.state is JobState.FAILED  # as the node ended it: nothing to cancel
    assert await listener.get_message(timeout=0.05) is None


async def test_timeout_waiting_for_the_next_event(ctx, redis):
    ctx.settings.request_timeout_s = 0.05
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    with pytest.raises(Timeout, match=job.id):
        async with job:
            await job.first_event()


async def test_a_batch_line_waits_its_turn_on_the_queue_past_the_silence_timeout(ctx, redis):
    """Unread on the queue (interactive jobs ahead), a batch line is not silent: it waits on; once a
    node has read it, silence is timed again."""
    ctx.settings.request_timeout_s = 0.05
    job = await submit(ctx, request(), ANONYMOUS_CALLER, job_class="batch")
    async with job:
        first = asyncio.create_task(job.first_event())
        await asyncio.sleep(0.3)  # six silence timeouts
        assert not first.done()
        await node_reads(redis, job)
        with pytest.raises(Timeout, match=job.id):
            await first


async def test_enqueue_failure_is_503_and_leaves_no_subscription(ctx, monkeypatch):
    async def broken_execute(*args, **kwargs):
        raise RedisConnectionError("gone")

    monkeypatch.setattr(type(ctx.redis.pipeline()), "execute", broken_execute)
    with pytest.raises(BrokerUnavailable, match="could not enqueue"):
        await submit(ctx, request(), ANONYMOUS_CALLER)
    assert ctx.bus.in_flight == 0


async def test_cancelled_consumer_still_cleans_up(ctx, redis):
    listener = await cancels(redis)
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    await node_reads(redis, job)

    reading = asyncio.Event()

    async def consume():
        async with job:
            reading.set()  # the test runs again once this task waits for the job's first event
            async for _ in job.events():
                pass

    task = asyncio.create_task(consume())
    await reading.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (await listener.get_message(timeout=1))["data"] == job.id.encode()
    assert ctx.bus.in_flight == 0


async def test_a_job_ends_once_and_reading_its_events_writes_nothing(ctx, redis):
    """Events read without side effects: the done event is in hand, yet nothing was written (the
    session's node is noted only when the job ends, in `close`); a detached job that ended cannot
    be detached or closed into another state."""
    job = await submit(ctx, request(), ANONYMOUS_CALLER, session="s1")
    await redis.publish(KEYS.events(job.id), pack_event(delta("a")))
    await redis.publish(KEYS.events(job.id), pack_event(done()))
    got = [event async for event in job.events()]
    assert [e.type for e in got] == ["delta", "done"] and job.state is JobState.RUNNING
    assert await redis.get(KEYS.session(MODEL, "s1")) is None
    await job.detach()  # the node ended it: detaching closes it
    assert job.state is JobState.FINISHED
    assert await redis.get(KEYS.session(MODEL, "s1")) == b"n1"  # its end noted where it ran
    await job.close()
    assert job.state is JobState.FINISHED and ctx.bus.in_flight == 0


async def test_a_streamed_job_whose_client_leaves_runs_on_detached(ctx, redis):
    listener = await cancels(redis)
    job = await submit(ctx, request(), ANONYMOUS_CALLER)
    job.on_disconnect = OnDisconnect.KEEP
    await job.detach()
    assert job.state is JobState.DETACHED and ctx.bus.in_flight == 0
    await job.close()  # ended: nothing more happens
    assert job.state is JobState.DETACHED
    assert await listener.get_message(timeout=0.05) is None  # not cancelled
    assert await redis.xlen(job.stream) == 1  # still queued for a node
