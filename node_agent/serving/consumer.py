"""The loop that feeds one replica from its model's job streams: it reads only as many entries as
the ledger has free slots (batch within its share), most urgent first (node_agent/serving/job_reader.py),
and, while others' jobs wait, newcomers' jobs beyond them (woken by the model's announcement),
and hands each read to the intake while it reads on. It rides out Redis outages (a log line when
one starts and ends), makes the consumer groups again when Redis lost them, settles the entries
Redis holds for jobs no longer here once Redis comes back, and can be paused. Whatever one read
does wrong fails that read's jobs, never the loop."""

import asyncio
import logging
import time

from redis.exceptions import RedisError, ResponseError

from node_agent.serving.intake import Intake, Prepared
from node_agent.serving.job_reader import BLOCK_MS, Entry, JobReader
from node_agent.serving.ledger import Ledger
from shared.errors import CortexError, GenerationFailed
from shared.redis_conn import Outage
from shared.wire import StreamEntry

log = logging.getLogger(__name__)


class Consumer:
    def __init__(self, reader: JobReader, ledger: Ledger, intake: Intake):
        self.reader, self.ledger, self.intake = reader, ledger, intake
        self._task: asyncio.Task | None = None
        self._adding: set[asyncio.Task] = set()  # prepared reads being handed to the engine
        self._running = False
        self._settle = False  # Redis came back: settle the entries it holds for jobs no longer here
        self._read_after = 0.0  # monotonic time before which nothing is read (pause)
        self._newcomer = asyncio.Event()  # a caller's first job joined a waiting room of the model

    def start(self) -> None:
        self._running = True
        self._task = asyncio.create_task(self._loop(), name=f"consume-{self.ledger.stream}")

    def halt(self) -> None:
        """Read nothing more from now on (slots freed later do not wake the loop); `stop` waits for it."""
        self._running = False
        self.ledger.slot_freed.set()

    async def stop(self) -> None:
        """Stop reading. The current read is let finish (at most a block timeout) and its entries
        admitted: cancelling it mid-read could strand entries Redis already handed over."""
        if self._task:
            self.halt()
            await asyncio.gather(self._task, return_exceptions=True)
            await asyncio.gather(*self._adding, return_exceptions=True)
            self._task = None

    def newcomer(self) -> None:
        """A caller's first job joined one of the model's waiting rooms (`Keys.newcomers`): a full
        replica reads now (it may take that job beyond its slots: `Ledger.newcomer_slots`)."""
        self._newcomer.set()

    def pause(self, seconds: float) -> None:
        """Read no new job for `seconds`: a gateway that lost Redis is subscribing again to its jobs
        still queued, and a job read before it listens again fails there (gateway/bus/router.py)."""
        self._read_after = max(self._read_after, time.monotonic() + seconds)

    def redis_came_back(self) -> None:
        """Redis restarted (from its append-only file, which may lack its last second): before its next
        read the loop acknowledges what Redis holds as delivered to this node but no job here runs
        (jobs whose acks Redis lost)."""
        self._settle = True
        self.ledger.slot_freed.set()

    async def settle_orphans(self) -> None:
        """Acknowledge the entries Redis holds as delivered to this consumer that no job here runs."""
        self._settle = False
        running = {r.entry_id for r in self.ledger.running.values()}
        orphans = [
            (stream, entry_id)
            for stream, entry_id in await self.reader.pending()
            if entry_id not in running
        ]
        if orphans:
            await self.reader.settle(orphans)
            log.info(
                "%s: acknowledged %d entries Redis held for jobs no longer running here",
                self.ledger.stream,
                len(orphans),
            )

    async def fail_own_backlog(self, error: CortexError) -> None:
        """End the unread jobs routed to this node alone with `error` (its replica failed to load);
        the model's moved and shared streams are the fleet's and stay queued."""
        try:
            await self.reader.ensure_groups()
            while entries := await self.reader.own_backlog():
                for e in entries:
                    self.ledger.refuse(
                        e.entry_id,
                        StreamEntry.channel_of(e.fields),
                        error,
                        e.stream,
                        StreamEntry.job_of(e.fields),
                    )
        except (
            OSError,
            RedisError,
        ) as exc:  # Redis away: the janitor moves this node's entries on when it is gone
            log.warning(
                "%s: could not fail the jobs routed here alone: %s", self.ledger.stream, exc
            )

    async def _loop(self) -> None:
        outage = Outage(log, f"reading {self.ledger.stream}")
        while self._running:
            free = self.ledger.free_slots
            try:
                if (
                    self._settle
                ):  # here, between reads: every entry read so far is in the ledger or has ended
                    await self.settle_orphans()
                if free <= 0 and self.ledger.newcomer_slots <= 0:
                    self.ledger.slot_freed.clear()
                    await self.ledger.slot_freed.wait()
                    continue
                if (paused_s := self._read_after - time.monotonic()) > 0:
                    await asyncio.sleep(paused_s)
                    continue
                self._newcomer.clear()  # (before the read: one announced during it is not missed)
                self.ledger.slot_freed.clear()
                entries = await self.reader.read(
                    free,
                    self.ledger.batch_free(free),
                    self.ledger.newcomer_slots,
                    self.ledger.tenants(),
                )  # most urgent first
                outage.ok()
                if not entries and self.reader.full:
                    await self._newcomer_or_freed_slot()
                    continue
            except ResponseError as exc:
                if "NOGROUP" in str(
                    exc
                ):  # the stream or group was deleted under us (a Redis that kept nothing)
                    log.warning("reading %s: %s; recreating the group", self.ledger.stream, exc)
                    await self._recreate_groups(outage)
                else:  # Redis refuses: out of memory, read-only, cannot persist
                    outage.failed(exc)
                    await asyncio.sleep(1)
                continue
            except (OSError, RedisError) as exc:
                outage.failed(exc)
                await asyncio.sleep(1)
                continue
            prepared = await self._prepare(
                entries
            )  # in the ledger now: the next read counts their slots
            # Read on while the device thread takes these: it admits every add queued between two
            # steps, so arrivals a read just missed still join the same prefill.
            adding = asyncio.create_task(self._add(prepared))
            self._adding.add(adding)
            adding.add_done_callback(self._adding.discard)

    async def _newcomer_or_freed_slot(self) -> None:
        """Wait (at most a block's time, as a blocked read would) for a newcomer or a freed slot."""
        waits = [
            asyncio.create_task(self._newcomer.wait()),
            asyncio.create_task(self.ledger.slot_freed.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=BLOCK_MS / 1000, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _prepare(self, entries: list[Entry]) -> list[Prepared]:
        """The read's entries prepared at once; one whose preparation broke (a bug) ends alone."""
        prepared = []
        for e, result in zip(
            entries,
            await asyncio.gather(
                *(self.intake.prepare(e) for e in entries), return_exceptions=True
            ),
        ):
            if isinstance(result, BaseException):
                log.error(
                    "preparing entry %s failed: %s: %s", e.entry_id, type(result).__name__, result
                )
                error = GenerationFailed(
                    f"the job could not start ({type(result).__name__}: {result})"
                )
                job = next(
                    (j for j, r in self.ledger.running.items() if r.entry_id == e.entry_id), None
                )
                if job is not None:
                    self.ledger.fail(job, error)
                else:
                    self.ledger.refuse(
                        e.entry_id,
                        StreamEntry.channel_of(e.fields),
                        error,
                        e.stream,
                    )
            elif result is not None:
                prepared.append(result)
        return prepared

    async def _add(self, jobs: list[Prepared]) -> None:
        try:
            await self.intake.add(jobs)
        except (
            Exception
        ) as exc:  # the hand-off itself failed (the engine went away meanwhile): these jobs fail
            log.exception("handing %d jobs to the engine failed", len(jobs))
            for request, *_ in jobs:
                self.ledger.fail(
                    request.job,
                    GenerationFailed(f"the job could not start ({type(exc).__name__}: {exc})"),
                )

    async def _recreate_groups(self, outage: Outage) -> None:
        try:
            await self.reader.ensure_groups()
        except RedisError as exc:
            outage.failed(exc)
            await asyncio.sleep(1)
