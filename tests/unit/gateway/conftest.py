"""Gateway unit-test fixtures: the app on fakeredis, an HTTP client over ASGI, heartbeats, and a
scripted node that stands in for a node agent (unit tests only; integration tests run real ones)."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import fakeredis
import httpx
import pytest
from fastapi import FastAPI
from redis.exceptions import ResponseError

from gateway.http.server import create_app
from node_agent.serving.heartbeat_writer import HeartbeatWriter
from shared import event_log, queues, usage_meter
from shared.catalog import DEFAULT_MODEL_ID
from shared.heartbeat import DeviceInfo, KVCacheStats, ModelInfo, NodeHeartbeat, SpecDecodeStats
from shared.keys import CONSUMER_GROUP, Keys
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from shared.wire import (
    ChoiceDelta,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    StreamEntry,
    Usage,
    pack_event,
)

KEYS = Keys()
MODEL = DEFAULT_MODEL_ID


def delta(text: str, index: int = 0, **fields) -> DeltaEvent:
    return DeltaEvent(choices=[ChoiceDelta(index=index, text=text, **fields)])


def done(prompt_tokens: int = 5, completion_tokens: int = 3, cached_tokens: int = 0) -> DoneEvent:
    return DoneEvent(
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        ),
        node="n1",
    )


WAIT_FOR_CANCEL = (
    "wait-for-cancel"  # a script step: stop here until the job is cancelled (then say so)
)

Script = Callable[[StreamEntry], list[DeltaEvent | DoneEvent | ErrorEvent | str | asyncio.Event]]


def hello_script(entry: StreamEntry) -> list:
    return [delta("Hel"), delta("lo"), delta("!", finish_reason="stop"), done()]


@dataclass
class ScriptedNode:
    """Reads the job stream like a node would (as consumer `n1`, the node `node` beats for), the jobs
    waiting in its rooms too, and answers each job with `script(entry)`."""

    redis: fakeredis.aioredis.FakeRedis
    script: Script = hello_script
    entries: list[StreamEntry] = field(default_factory=list)
    subscribers_at_read: list[int] = field(default_factory=list)  # listeners on `reply` when read
    cancelled: list[str] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)

    async def run(self, stream: str) -> None:
        cancels = self.redis.pubsub()
        await cancels.subscribe(KEYS.cancel())
        with contextlib.suppress(ResponseError):  # BUSYGROUP: made already
            await self.redis.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        while True:
            while (
                message := await cancels.get_message(ignore_subscribe_messages=True, timeout=0)
            ) is not None:
                self.cancelled.append(message["data"].decode())
            await self._take_waiting_rooms(stream)
            for _, entries in (
                await self.redis.xreadgroup(CONSUMER_GROUP, "n1", {stream: ">"}, count=16) or []
            ):
                for _entry_id, fields in entries:
                    task = asyncio.create_task(self._answer(StreamEntry.from_fields(fields)))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(0.005)

    async def _take_waiting_rooms(self, stream: str) -> None:
        """Every job waiting in the stream's rooms onto it, a job per room in turn (a node's reader
        moves them one at a time as it reads them: shared/queues.py)."""
        name = queues.parse(KEYS, stream)
        ring = KEYS.waiting_keys(name.model, name.job_class, name.band)
        while room := await self.redis.lpop(ring):
            for entry_id, fields in await self.redis.xrange(room, count=1):
                await self.redis.xdel(room, entry_id)
                await self.redis.xadd(stream, fields)
            if await self.redis.xlen(room):
                await self.redis.rpush(ring, room)
            else:
                await self.redis.delete(room)

    async def _answer(self, entry: StreamEntry) -> None:
        self.entries.append(entry)
        [(_, listeners)] = await self.redis.pubsub_numsub(entry.channel)
        self.subscribers_at_read.append(listeners)
        for step in self.script(entry):
            if isinstance(step, asyncio.Event):  # a gate the test opens
                await step.wait()
                continue
            if step == WAIT_FOR_CANCEL:
                while entry.job not in self.cancelled:
                    await asyncio.sleep(0.005)
                await self.publish(
                    entry, ErrorEvent(code="cancelled", message=f"job {entry.job} was cancelled")
                )
                return
            await self.publish(entry, step)

    async def publish(self, entry: StreamEntry, event) -> None:
        """As a node does: to the job's event log (if it has one), then to its channel; a done event
        with the count of the job's tokens against its key, when it has one."""
        packed = pack_event(event)
        async with self.redis.pipeline(transaction=False) as pipe:
            event_log.append(pipe, KEYS.event_log(entry.job), [packed], 600)
            pipe.publish(entry.channel, packed)
            if isinstance(event, DoneEvent) and entry.api_key:
                usage_meter.charge(pipe, KEYS, entry.api_key, entry.job, event.usage, 600)
            await pipe.execute()


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def redis_factory(fake_server: fakeredis.FakeServer) -> Callable[[], fakeredis.aioredis.FakeRedis]:
    return lambda: fakeredis.aioredis.FakeRedis(server=fake_server)


@pytest.fixture
async def redis(redis_factory) -> AsyncIterator[fakeredis.aioredis.FakeRedis]:
    client = redis_factory()
    yield client
    await client.aclose()


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(redis_url="redis://fake", node_ttl_s=8.0, request_timeout_s=5.0)


@pytest.fixture
async def app(settings: GatewaySettings, redis_factory) -> AsyncIterator[FastAPI]:
    app = create_app(settings, redis_factory=redis_factory)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway"
    ) as client:
        yield client


async def beat(
    redis,
    node: str = "n1",
    models: dict[str, ModelState] | None = None,
    *,
    age_s: float = 0.0,
    state: str = "active",
    kv: dict[str, KVCacheStats] | None = None,
    max_model_len: int = 0,
    free_mb: int = 0,
    spec: dict[str, SpecDecodeStats] | None = None,
    quant: str = "",
    weight_mb: int = 0,
    kernels: str = "",
) -> NodeHeartbeat:
    """Write a heartbeat as a node agent would (node_agent/serving/heartbeat_writer.py); `kv` gives models their KV cache figures, `spec`
    their speculative decoding's, and all run with `max_model_len` (0: not said) and hold their
    weights as `quant` in `weight_mb`, running `kernels` (not said: ""/0); a CPU device with `free_mb` free, when given
    (placement reads it)."""
    now_ms = int((time.time() - age_s) * 1000)
    models = {MODEL: ModelState.READY} if models is None else models
    kv, spec = kv or {}, spec or {}
    heartbeat = NodeHeartbeat(
        node=node,
        version="test",
        state=state,
        started_ms=now_ms - 60_000,
        heartbeat_ms=now_ms,
        devices=[DeviceInfo(id="cpu", name="cpu", total_mb=free_mb, free_mb=free_mb)]
        if free_mb
        else [],
        models={
            name: ModelInfo(
                state=s,
                device="cpu",
                slots_total=4,
                kv=kv.get(name),
                spec=spec.get(name),
                max_model_len=max_model_len,
                quant=quant,
                weight_mb=weight_mb,
                kernels=kernels,
            )
            for name, s in models.items()
        },
    )
    writer = HeartbeatWriter(KEYS, node, ttl_ms=60_000)  # the hash, its score, the change stream
    writer.seq = int(await redis.hget(KEYS.node(node), "seq") or 0)
    async with redis.pipeline(transaction=False) as pipe:
        writer.write(pipe, heartbeat)
        await pipe.execute()
    return heartbeat


@pytest.fixture
async def node(app: FastAPI, redis) -> AsyncIterator[ScriptedNode]:
    """A live node serving the default model, answering jobs by its script."""
    await beat(redis)
    scripted = ScriptedNode(redis)
    task = asyncio.create_task(scripted.run(KEYS.jobs(MODEL)))
    yield scripted
    for running in [task, *scripted.tasks]:
        running.cancel()
    await asyncio.gather(task, *scripted.tasks, return_exceptions=True)
