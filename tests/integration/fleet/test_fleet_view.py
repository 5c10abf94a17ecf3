"""The heartbeat sized by what changed (node_agent/serving/heartbeat_writer.py) and the gateway's
fleet view that follows it (shared/fleet_view.py), on a real Redis: a beat that changed nothing
writes no field but its time and no change entry; the view learns a node's changes from the change
stream without reading its hash, reads a node whole when its changes do not follow on, and drops a
node whose heartbeats stop."""

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from node_agent.serving.heartbeat_writer import HeartbeatWriter
from shared.fleet_view import FleetView
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.keys import Keys

pytestmark = pytest.mark.integration
KEYS = Keys()


def _beat(node: str, started_ms: int, **models: str) -> NodeHeartbeat:
    return NodeHeartbeat(
        node=node,
        version="t",
        started_ms=started_ms,
        heartbeat_ms=int(time.time() * 1000),
        models={m: ModelInfo(state=state, device="cpu") for m, state in models.items()},
    )


async def _send(redis, writer: HeartbeatWriter, beat: NodeHeartbeat) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        writer.write(pipe, beat)
        writer.settle(await pipe.execute())


async def _calls(redis, command: str) -> int:
    return int((await redis.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the view did not catch up"
        await asyncio.sleep(0.02)


def test_a_beat_writes_what_changed(redis_url):
    async def run() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        writer = HeartbeatWriter(KEYS, "n1", 8000)
        await _send(redis, writer, _beat("n1", 1, m="loading"))
        assert await redis.xlen(KEYS.fleet_changes()) == 1
        await _send(redis, writer, _beat("n1", 1, m="loading"))
        assert await redis.xlen(KEYS.fleet_changes()) == 1, "nothing changed: no change entry"
        await _send(redis, writer, _beat("n1", 1, m="ready"))
        (_, last), *_ = await redis.xrevrange(KEYS.fleet_changes(), count=1)
        assert set(last) == {b"node", b"started_ms", b"models", b"seq"}, last
        stored = NodeHeartbeat.from_hash(await redis.hgetall(KEYS.node("n1")))
        assert stored.models["m"].state == "ready" and stored.seq == 2
        await redis.delete(KEYS.node("n1"))  # a Redis that lost it
        await _send(redis, writer, _beat("n1", 1, m="ready"))
        await _send(redis, writer, _beat("n1", 1, m="ready"))
        assert NodeHeartbeat.from_hash(await redis.hgetall(KEYS.node("n1"))).models == stored.models
        await redis.delete(KEYS.node("n1"))  # expired: the node's beats came too late
        late = _beat("n1", 1, m="ready")
        late.heartbeat_ms += 5000  # over half the TTL after the last: every field again
        await _send(redis, writer, late)
        assert NodeHeartbeat.from_hash(await redis.hgetall(KEYS.node("n1"))).models == stored.models
        await redis.aclose()

    asyncio.run(run())


def test_the_view_follows_changes_without_reading_hashes(redis_url):
    async def run() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        n1, n2 = HeartbeatWriter(KEYS, "n1", 8000), HeartbeatWriter(KEYS, "n2", 8000)
        await _send(redis, n1, _beat("n1", 1, a="ready"))
        view = FleetView(redis, KEYS, node_ttl_s=8.0, poll_s=0.1)
        await view.start()
        try:
            assert [n.node for n in view.live_nodes()] == ["n1"] and view.fresh
            await _send(redis, n2, _beat("n2", 5, b="loading"))  # a new node: read whole once
            await _until(lambda: [n.node for n in view.holders("b")] == ["n2"])
            reads = await _calls(redis, "hgetall")
            for state in ("ready", "poisoned", "ready"):
                await _send(redis, n1, _beat("n1", 1, a="ready", b=state))
            await _until(lambda: "n1" in {n.node for n in view.holders("b")})
            await _until(lambda: view.live_nodes()[0].models["b"].state == "ready")
            assert await _calls(redis, "hgetall") == reads, "changes came from the stream"
            n1.seq += 5  # changes the view never saw: it reads the node whole
            await _send(redis, n1, _beat("n1", 1, c="loading"))
            await _until(lambda: "c" in view.live_nodes()[0].models)
            assert await _calls(redis, "hgetall") == reads + 1
            await redis.zrem(KEYS.nodes(), "n2")  # its heartbeats stopped long ago
            await _until(lambda: [n.node for n in view.live_nodes()] == ["n1"])
            assert view.holders("b") == [] and [n.node for n in view.holders("c")] == ["n1"]
        finally:
            await view.stop()
            await redis.aclose()

    asyncio.run(run())


def test_sync_catches_the_view_up_at_once(redis_url):
    """A reader that answers what a caller just changed (a node it started, a model it loaded)
    waits for `sync`: the view then has every beat Redis took, though it polls only every minute,
    from the change stream and one liveness read, without reading the nodes it knows whole."""

    async def run() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        n1, n2 = HeartbeatWriter(KEYS, "n1", 8000), HeartbeatWriter(KEYS, "n2", 8000)
        await _send(redis, n1, _beat("n1", 1, a="loading"))
        view = FleetView(redis, KEYS, node_ttl_s=8.0, poll_s=60.0)
        await view.start()
        try:
            await asyncio.sleep(0.1)  # the follower waits on the stream (it may take what follows)
            await _send(redis, n2, _beat("n2", 5, b="ready"))  # a node joins
            await _send(redis, n1, _beat("n1", 1, a="ready"))  # a model becomes ready
            await view.sync()
            assert [n.node for n in view.live_nodes()] == ["n1", "n2"]
            assert view.live_nodes()[0].models["a"].state == "ready"
            reads = await _calls(redis, "hgetall")
            await _send(redis, n1, _beat("n1", 1, a="ready", b="loading"))
            await view.sync()
            assert [n.node for n in view.holders("b")] == ["n1", "n2"]
            assert await _calls(redis, "hgetall") == reads, (
                "a known node's change came from the stream"
            )
        finally:
            await view.stop()
            await redis.aclose()

    asyncio.run(run())


def test_a_node_back_after_a_stall_goes_on_from_the_stream(redis_url):
    """Every node late at once (its host, or Redis, stalled longer than the TTL): each is left out
    while it is late, and when it beats again the view goes on from its change entries instead of
    every gateway reading every node's hash at once; a node away longer than `forget_after_s` is
    forgotten (read whole if it ever comes back)."""

    async def run() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        n1 = HeartbeatWriter(KEYS, "n1", 8000)
        await _send(redis, n1, _beat("n1", 1, a="ready"))
        view = FleetView(redis, KEYS, node_ttl_s=8.0, poll_s=0.05, forget_after_s=0.6)
        await view.start()
        try:
            reads = await _calls(redis, "hgetall")
            await redis.zadd(KEYS.nodes(), {"n1": 1})  # its last beat: long ago
            await _until(lambda: view.live_nodes() == [] and view.holders("a") == [])
            await _send(redis, n1, _beat("n1", 1, a="ready", b="loading"))  # back, one change on
            await _until(lambda: [n.node for n in view.holders("b")] == ["n1"])
            assert await _calls(redis, "hgetall") == reads, "it went on from the change stream"
            await redis.zadd(KEYS.nodes(), {"n1": 1})
            await asyncio.sleep(1.0)  # away past forget_after_s
            await _send(redis, n1, _beat("n1", 1, a="ready", b="ready"))
            await _until(lambda: [n.node for n in view.holders("b")] == ["n1"])
            assert await _calls(redis, "hgetall") == reads + 1, "forgotten: read whole"
        finally:
            await view.stop()
            await redis.aclose()

    asyncio.run(run())
