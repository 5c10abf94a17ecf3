"""A job whose events' pub/sub connection Redis cuts (`CLIENT KILL TYPE pubsub`, as Redis does to a
subscriber past its output buffer limit) reads on from its event log: every event once, in order,
whether it was published before, during or after the gap (issue 49). The gateway's app runs on a
real redis-server here; the node is its real publisher."""

import contextlib
import shutil

import pytest
import redis.asyncio as aioredis

from gateway.jobs.caller import ANONYMOUS_CALLER
from gateway.jobs.submit import submit
from node_agent.serving.output_messages import Outgoing
from node_agent.serving.publisher import Publisher
from shared.errors import BrokerUnavailable
from shared.redis_conn import connect
from tests.conftest import eventually
from tests.unit.gateway.conftest import KEYS, delta, done
from tests.unit.gateway.jobs.test_jobs import request

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture
def redis_factory(redis_url):
    return lambda: aioredis.Redis.from_url(redis_url)


@pytest.fixture
def ctx(app):
    return app.state.ctx


@contextlib.asynccontextmanager
async def cut_mid_job(ctx, redis, redis_url, streaming: bool = True):
    """A running job whose node (the real publisher) sent events 0-4, of which the gateway took 3,
    when Redis cut the gateway's pub/sub link; the node then sent 5-9, which only the log has.
    Yields the job, its event iterator, the events taken, and `step` (the node sends more)."""
    job = await submit(ctx, request(), ANONYMOUS_CALLER, streaming=streaming)
    node = Publisher(connect(redis_url), KEYS, "n1", on_unheard=lambda job: None)
    node.start()
    channel = KEYS.events(job.id)

    def step(*events) -> None:
        node.send([Outgoing(channel, list(events), job=job.id)])

    async with job:
        events = job.events()
        for i in range(5):
            step(delta(str(i)))
        got = [await anext(events) for _ in range(3)]
        assert await redis.client_kill_filter(_type="pubsub") >= 1
        for i in range(5, 10):  # published while nobody listens: only the log has them
            step(delta(str(i)))
        await node.flush()
        yield job, events, got, step
    await node.stop()


@pytest.mark.parametrize("streaming", [False, True], ids=["answer", "stream"])
async def test_a_running_job_reads_on_from_its_log_when_redis_cuts_the_link(
    ctx, redis, redis_url, streaming
):
    async with cut_mid_job(ctx, redis, redis_url, streaming) as (job, events, got, step):
        await eventually(lambda: ctx.bus.connected, 5, "the bus reconnected")
        step(delta("10"), done())
        got += [event async for event in events]
    assert [e.choices[0].text for e in got if e.type == "delta"] == [str(i) for i in range(11)]
    assert got[-1].type == "done"
    assert not await redis.exists(
        KEYS.event_log(job.id)
    )  # nobody can resume it: deleted at its end


async def test_events_a_redis_lost_from_the_log_fail_the_job_rather_than_leave_a_hole(
    ctx, redis, redis_url
):
    """The log lost two entries the node wrote (as a replica promoted before it had them would):
    reading on finds the gap by each entry's place among the job's events and ends the job with an
    error naming Redis, never an answer with two events missing."""
    async with cut_mid_job(ctx, redis, redis_url) as (job, events, got, step):
        logged = await redis.xrange(KEYS.event_log(job.id))
        assert [int(fields[b"at"]) for _, fields in logged[1:]] == list(range(10))
        await redis.xdel(KEYS.event_log(job.id), logged[1 + 6][0], logged[1 + 7][0])
        step(delta("10"), done())
        with pytest.raises(BrokerUnavailable, match="Redis lost events 6-7"):
            async for event in events:
                got.append(event)
    assert [e.choices[0].text for e in got] == [str(i) for i in range(6)]
