"""Sends engine results to Redis: every step's events for every job, with the acks of jobs that
ended, in one pipelined round trip. One task drains a queue, so events keep their order.

When Redis does not take a round trip (it restarted, or is unreachable for longer than the
client's retries), its events are lost and never sent again (a listener would get them twice or
out of order). What must still happen is kept and retried until Redis answers: each ended job's
acknowledgement, with an error event in place of its lost ones (a gateway still listening learns
the job failed rather than waiting for a `done` that will not come). Each job still running whose
events were lost is reported to `on_lost`, which fails it."""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import BrokerUnavailable
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_conn import Outage
from shared.wire import ErrorEvent, Event, pack_event

log = logging.getLogger(__name__)

RETRY_S = 1.0  # how often kept acknowledgements are retried while nothing else is sent


class Outgoing(msgspec.Struct, array_like=True, omit_defaults=True):
    """One job's events of one step (a Struct: the node hands these to its output process)."""

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
    on_lost: Callable[[str], None] = lambda job: None  # a running job whose events Redis did not take
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _task: asyncio.Task | None = None
    _kept: list[Outgoing] = field(default_factory=list)  # what a failed round trip must still do
    _outage: Outage = field(default_factory=lambda: Outage(log, "publisher"))

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
            try:
                batches = [await asyncio.wait_for(self._queue.get(), RETRY_S if self._kept else None)]
            except TimeoutError:
                batches = []
            while not self._queue.empty():
                batches.append(self._queue.get_nowait())
            kept, self._kept = self._kept, []
            outgoing = kept + [o for b in batches for o in b]
            try:
                await self._send(outgoing)
                self._outage.ok()
            except (RedisError, OSError) as exc:
                self._outage.failed(exc)
                self._keep(outgoing)
            except Exception:
                log.exception("publishing %d batches failed", len(batches))
            finally:
                for _ in batches:
                    self._queue.task_done()

    def _keep(self, failed: list[Outgoing]) -> None:
        """After a failed round trip: keep each ended job's acknowledgement (its lost events replaced
        by one error event) to retry; report each running job whose events were lost."""
        for item in failed:
            if item.ack:
                error = BrokerUnavailable(f"node {self.node} lost its connection to Redis; the job's output was lost")
                events = [ErrorEvent(code=error.code, message=error.message)] if item.events else []
                self._kept.append(Outgoing(item.channel, events, item.ack, item.job, tracked=item.tracked))
            elif item.events and item.job:
                self.on_lost(item.job)

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
