"""Sends engine results to Redis: every step's events for every job, with the acks of jobs that
ended (and the count of their tokens against the API key that sent them, shared/usage_meter.py),
in one pipelined round trip. One task drains a queue, so events keep their order.

When Redis does not take a round trip (it restarted, or is unreachable for longer than the
client's retries), its events are lost and never sent again (a listener would get them twice or
out of order). What must still happen is kept and retried until Redis answers: each ended job's
acknowledgement and token count, with an error event in place of its lost ones (a gateway still listening learns
the job failed rather than waiting for a `done` that will not come). Each job still running whose
events were lost is reported to `on_lost`, which fails it.

An event larger than `max_event_bytes` (an embedding job's vectors, prompt logprobs, a long
answer not streamed) is written to the job's `Keys.result` hash in the same round trip, and a
`StoredEvent` pointing to it is published (and logged) in its place: pub/sub never carries a message
near Redis's output buffer limit, whose breach would cut every job on the subscribing gateway.

A job a client may resume has an event log (`shared.event_log`, made by the gateway): each step's
events for it are appended there too, in the same round trip, and the log's expiry is renewed
while it runs and set once more when it ends. Such a job runs on when nobody listens (its client
may come back, or asked it to run on); a job without a log nobody listens to is reported to
`on_unheard`, which cancels it."""

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from node_agent.serving.cache_index import CacheIndex
from node_agent.serving.output_messages import Outgoing
from shared import event_log, usage_meter
from shared.errors import BrokerUnavailable, CortexError, GenerationFailed
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_conn import Outage, publish
from shared.wire import ErrorEvent, StoredEvent, pack_event

log = logging.getLogger(__name__)

RETRY_S = 1.0  # how often kept acknowledgements are retried while nothing else is sent
NO_LOG = -1.0  # in `Publisher._logs`: the job has no event log


class _Stored(bytes):
    """A packed `StoredEvent` (its event was written to `Keys.result` in the same round trip)."""


@dataclass
class Publisher:
    redis: aioredis.Redis
    keys: Keys
    node: str
    on_unheard: Callable[[str], None]  # a job nobody listens to any more (its gateway is gone)
    on_lost: Callable[[str], None] = lambda job: (
        None
    )  # a running job whose events Redis did not take
    retention_s: int = 600  # a job's event log lives this long after it ends (`stream_retention_s`)
    max_event_bytes: int = 64 << 10  # larger events go to `Keys.result` (NodeSettings)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _task: asyncio.Task | None = None
    _kept: list[Outgoing] = field(default_factory=list)  # what a failed round trip must still do
    _outage: Outage = field(default_factory=lambda: Outage(log, "publisher"))
    _logs: dict[str, float] = field(
        default_factory=dict
    )  # job -> when its log's expiry is due again, or NO_LOG
    _logged: dict[str, int] = field(default_factory=dict)  # job -> events its log holds
    cache_index: CacheIndex | None = None  # the model's prefix marks, written with each round trip
    _stored: itertools.count = field(default_factory=itertools.count)  # fields of `Keys.result`
    _stored_prefix: str = field(
        default_factory=lambda: secrets.token_hex(4)
    )  # unique per publisher

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
                batches = [
                    await asyncio.wait_for(self._queue.get(), RETRY_S if self._kept else None)
                ]
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
                self._keep(
                    outgoing,
                    BrokerUnavailable(
                        f"node {self.node} lost its connection to Redis; the job's output was lost"
                    ),
                )
            except Exception as exc:  # a bug (an event that cannot be packed): the jobs end, their entries are settled
                log.exception("publishing %d batches failed", len(batches))
                self._keep(
                    outgoing,
                    GenerationFailed(
                        f"node {self.node} could not publish the job's output "
                        f"({type(exc).__name__}: {exc})"
                    ),
                )
            finally:
                for _ in batches:
                    self._queue.task_done()

    def _keep(self, failed: list[Outgoing], error: CortexError) -> None:
        """After a failed round trip: keep each ended job's acknowledgement (its lost events replaced
        by one error event, `error`) to retry; report each running job whose events were lost."""
        for item in failed:
            if item.ack:
                events = [ErrorEvent(code=error.code, message=error.message)] if item.events else []
                self._kept.append(
                    Outgoing(
                        item.channel,
                        events,
                        item.ack,
                        item.job,
                        streaming=item.streaming,
                        charge=item.charge,
                    )
                )
            elif item.events and item.job:
                self.on_lost(item.job)

    async def _send(self, outgoing: list[Outgoing]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        started = self.keys.started(self.node)
        now = time.monotonic()
        expiring = []
        logged: dict[str, int] = {}  # job -> events its log holds once this round trip is taken
        stored = []  # per item: its events written to `Keys.result` (two replies each)
        for item in outgoing:
            packed = [self._bounded(pipe, item, pack_event(event)) for event in item.events]
            stored.append(sum(isinstance(p, _Stored) for p in packed))
            expiring.append(self._append_to_log(pipe, item, packed, now, logged))
            if item.started:
                pipe.sadd(started, item.job)
            for event in packed:
                publish(pipe, item.channel, event, sharded=self.keys.cluster)
            if item.ack:
                stream, entry_id = item.ack
                pipe.xack(stream, CONSUMER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                if item.streaming:
                    pipe.srem(started, item.job)
                if item.charge is not None:
                    usage_meter.charge(
                        pipe,
                        self.keys,
                        item.charge.api_key,
                        item.job,
                        item.charge.usage,
                        self.retention_s,
                    )
        marks = (
            self.cache_index.write(pipe) if self.cache_index is not None else None
        )  # replies after the items'
        try:
            replies = iter(await pipe.execute())
        except BaseException:
            if marks is not None:
                self.cache_index.restore(marks)
            raise
        self._logged.update(logged)
        for item, expire, kept in zip(outgoing, expiring, stored):
            for _ in range(2 * kept):
                next(replies)
            logged = None if expire is None else next(replies) is not None
            if expire:
                next(replies)
            if item.started:
                next(replies)
            counts = [next(replies) for _ in item.events]
            if item.ack:
                next(replies), next(replies)
                if item.streaming:
                    next(replies)
                if item.charge is not None:
                    next(replies)
                self._logs.pop(item.job, None)
                self._logged.pop(item.job, None)
                continue
            if logged is False:
                self._logs[item.job] = NO_LOG
                self._logged.pop(item.job, None)
            elif expire:
                self._logs[item.job] = now + self.retention_s / 2
            if counts and max(counts) == 0 and not logged:
                self.on_unheard(item.job)

    def _bounded(self, pipe, item: Outgoing, packed: bytes) -> bytes:
        """`packed`, or where it is larger than `max_event_bytes`, a `StoredEvent` pointing to it,
        written to the job's `Keys.result` hash (with its expiry) on `pipe` first."""
        if len(packed) <= self.max_event_bytes or not item.job:
            return packed
        name = f"{self._stored_prefix}-{next(self._stored)}"
        result = self.keys.result(item.job)
        pipe.hset(result, name, packed)
        pipe.expire(result, self.retention_s)
        return _Stored(pack_event(StoredEvent(field=name, size=len(packed))))

    def _append_to_log(
        self, pipe, item: Outgoing, packed: list[bytes], now: float, logged: dict[str, int]
    ) -> bool | None:
        """Queue the item's events for its job's log, at their place in the job's events (`logged`:
        the places this round trip reached), with the log's expiry when it is due (first write,
        half the retention since the last, the job's end); None if the job has no log."""
        if not item.job or not packed or (due := self._logs.get(item.job)) == NO_LOG:
            return None
        expire = item.ack is not None or due is None or now >= due
        at = logged.get(item.job, self._logged.get(item.job, 0))
        event_log.append(
            pipe, self.keys.event_log(item.job), packed, self.retention_s if expire else None, at
        )
        logged[item.job] = at + len(packed)
        return expire
