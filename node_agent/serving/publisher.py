"""Sends engine results to Redis: every step's events for every job, with the acks of jobs that
ended, in one pipelined round trip. One task drains a queue, so events keep their order."""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import redis.asyncio as aioredis

from shared.keys import CONSUMER_GROUP, Keys
from shared.wire import Event, pack_event

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    channel: str
    events: list[Event]  # in order
    ack: tuple[str, str] | None = None  # (stream, entry id) to XACK + XDEL after publishing
    job: str = ""
    started: bool = False  # a streaming job's first output: noted in `Keys.started` (before it is published)
    tracked: bool = False  # a streaming job whose note is dropped when it ends (with `ack`)


@dataclass
class Publisher:
    redis: aioredis.Redis
    keys: Keys
    node: str
    on_unheard: Callable[[str], None]  # a job nobody listens to any more (its gateway is gone)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="publisher")

    def send(self, batch: list[Outgoing]) -> None:
        self._queue.put_nowait(batch)

    async def flush(self) -> None:
        await self._queue.join()

    async def stop(self) -> None:
        await self.flush()
        if self._task:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            batches = [await self._queue.get()]
            while not self._queue.empty():
                batches.append(self._queue.get_nowait())
            try:
                await self._send([o for b in batches for o in b])
            except Exception:
                log.exception("publishing %d batches failed", len(batches))
            finally:
                for _ in batches:
                    self._queue.task_done()

    async def _send(self, outgoing: list[Outgoing]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        started = self.keys.started(self.node)
        for item in outgoing:
            if item.started:
                pipe.sadd(started, item.job)
            for event in item.events:
                pipe.publish(item.channel, pack_event(event))
            if item.ack:
                stream, entry_id = item.ack
                pipe.xack(stream, CONSUMER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                if item.tracked:
                    pipe.srem(started, item.job)
        results = await pipe.execute()
        receivers = iter(results)
        for item in outgoing:
            if item.started:
                next(receivers)
            counts = [next(receivers) for _ in item.events]
            if item.ack:
                next(receivers), next(receivers)
                if item.tracked:
                    next(receivers)
            elif counts and max(counts) == 0:
                self.on_unheard(item.job)
