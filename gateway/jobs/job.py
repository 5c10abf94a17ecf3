"""A job as the gateway that submitted it follows it (gateway/jobs/submit.py makes one): its
state (`shared.lifecycle.JobState`: queued until a node's first event, then running; it ends once,
in `close` or `detach`), its place in the queue while it waits, and its events as they come.

`Job.events()` yields its deltas up to the `done` event; an error event raises the typed error the
node reported. Reading events changes nothing outside the job: what a job's end means (its session
noted for routing, its tokens counted on the key's metrics, its cancellation when it did not
finish, the subscription dropped) happens in `close()`, which always runs (the routes see to it).
Every job has an event log (`shared.event_log`, made by gateway/jobs/submit.py). When the bus's
link drops (Redis restarts, or cuts the connection), the bus tells the job `EventsMissed`: from then
on it reads its events from the log, after the ones it had taken, waking at each PUBLISH, so it goes
on with every event exactly once (a resumed job, gateway/jobs/resume.py, reads the log from the
start). A job nobody can resume deletes its log and stored results when it ends.

When the client went away, `detach()` runs instead: the job's `on_disconnect` says whether it is
cancelled at once, after `disconnect_grace_s` unless someone resumes it
(gateway/jobs/departures.py), or never (`background`).
"""

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import anyio
from redis.exceptions import RedisError

from gateway.bus.listeners import EventsMissed, Item
from gateway.dialects.tools.parsers import Parsers, no_parser
from gateway.jobs import queue
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.tracing import JobTrace, request_id_var
from shared import event_log, stored_events
from shared.errors import (
    BrokerUnavailable,
    CortexError,
    GenerationFailed,
    QueueTimeout,
    Timeout,
    error_from_code,
)
from shared.lifecycle import JobState
from shared.redis_conn import broker_error, publish
from shared.wire import DeltaEvent, DoneEvent, ErrorEvent, StartEvent, StoredEvent, WireError

log = logging.getLogger(__name__)

READ_COUNT = 512  # event log entries read per round trip
LOG_RETRY_S = 0.2  # how often a job whose link dropped tries its log again while Redis is away


class OnDisconnect(StrEnum):
    """What a client going away does to its job."""

    CANCEL = "cancel"  # at once: nobody can resume it (not streamed)
    GRACE = "grace"  # after `disconnect_grace_s`, unless a client resumes it meanwhile
    KEEP = "keep"  # nothing: it runs to its end (`background`)


@dataclass
class Resumable:
    """How a resumable job is rendered again (the first entry of its event log): its dialect, what
    that dialect's renderer needs besides the events (`spec`), and whose it is."""

    dialect: str  # chat | completions | messages | responses
    spec: dict[str, Any] = field(default_factory=dict)
    on_disconnect: OnDisconnect = OnDisconnect.GRACE
    owner: str = ""  # the API key's name (`Caller.name`); only that caller may resume it
    metered: bool = False  # its tokens count against `owner`'s limits
    model: str = ""
    created: int = 0
    tools: str | None = None  # the tool-call parser's format, when the request has tools
    prompt_text: str | None = None  # the prompt's text, when the request asked to echo it

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: bytes) -> "Resumable":
        fields = json.loads(raw)
        return cls(**fields | {"on_disconnect": OnDisconnect(fields["on_disconnect"])})


class Job:
    def __init__(
        self,
        ctx: JobContext,
        job: str,
        model: str,
        heard: asyncio.Queue[Item],
        caller: Caller,
        *,
        parsers: Parsers = no_parser,
        metered: bool = False,
        prompt_text: str | None = None,
        on_disconnect: OnDisconnect = OnDisconnect.CANCEL,
        created: int | None = None,
        timed: bool = True,
        trace: JobTrace | None = None,
        session: str = "",
        streamed: bool = True,
    ):
        """`streamed`: the node sends its tokens as they come (else joined: NodeSettings.whole_flush_s)."""
        self.id = job
        self.model = model
        self.state = JobState.QUEUED
        self.created = int(time.time()) if created is None else created
        self.request_id = request_id_var.get()
        self.caller = caller  # whose job it is: its tokens count against the key's budgets
        self.parsers = parsers  # a fresh tool-call parser per choice of the response
        self.metered = metered
        self.on_disconnect = on_disconnect
        self.after = (
            -1
        )  # the number of the last frame the client has seen (a resumed stream goes on after it)
        self.prompt_tokens = 0  # the prompt's length, once the node's start event told it
        self.prompt_text = prompt_text  # the prompt's text when the request asked to echo it
        self.stream = (
            ""  # the job stream it was queued on, and its entry id there ("": not known here)
        )
        self.entry_id = ""
        self.queue_deadline: float | None = None  # loop time after which it leaves the queue
        self.waits_its_turn = False  # a batch line: unread on the queue, it is not silent
        self.trace = trace or JobTrace(
            job, model
        )  # its part of the request's trace (gateway/tracing.py)
        self.session = (
            session  # its session's name (`shared.prefix_marks.session`), for routing its next turn
        )
        self._ctx = ctx
        self._heard = heard  # what the bus hears on the job's channel (gateway/bus/router.py)
        self._first: DeltaEvent | DoneEvent | None = None  # read by `first_event`, not yet yielded
        self._ending: DoneEvent | ErrorEvent | None = None  # how the node ended it, once it did
        self.logged = False  # it has an event log: a dropped link reads on from there
        self._taken = 0  # the job's events taken so far (from the bus, then from the log)
        self._last: bytes | None = None  # reading the event log: the last entry read
        self._logged = 0  # reading the event log: the job's events up to the last entry read
        self._read: deque[Item] = deque()  # read from the log, not yet taken
        self._outage_until: float | None = None  # Redis away since the link dropped: retry until
        self._timer = ctx.metrics.request(self.model, time.monotonic(), streamed) if timed else None

    def _become(self, state: JobState) -> None:
        if not self.state.may_become(state):
            raise RuntimeError(f"job {self.id} cannot go from {self.state} to {state}")
        self.state = state

    # ---- while it waits ---------------------------------------------------------------------------

    async def position(self) -> int:
        """0 once a node has read the job (or where its entry is not known here); else 1 + the jobs
        nodes will read before it."""
        if not self.entry_id:
            return 0
        return await queue.position(self._ctx.redis, self._ctx.keys, self.stream, self.entry_id)

    async def first_event_or_position(self, first: asyncio.Future) -> int:
        """Wait briefly for the job's first event (`first`, a task of `first_event`; 0: it came, or
        a node is already on the job and it will come); else return the job's queue position, so a
        streamed response can start at once. A job whose entry is not known here (a resumed one)
        waits for its first event."""
        done, _ = await asyncio.wait({first}, timeout=self._ctx.settings.queued_after_s)
        if not done and (place := await self.position()) > 0:
            return place
        await first  # a node has it: the first token is a prefill away; an error before any output is an HTTP status
        return 0

    async def places(self, first: asyncio.Future, place: int) -> AsyncIterator[int]:
        """While the job waits for its first event: its place, now and as it changes (read every
        `queue_position_poll_s`)."""
        while not first.done():
            if place > 0:
                yield place
            await asyncio.wait({first}, timeout=self._ctx.settings.queue_position_poll_s)
            if not first.done() and place > 0:
                try:
                    place = await self.position()
                except (
                    RedisError
                ):  # Redis restarting: the job waits on (gateway/bus/), so does its place
                    pass

    # ---- its events -------------------------------------------------------------------------------

    async def first_event(self) -> None:
        """Wait for the first delta or done event, so that an error before any output (context too
        long, the model failed to load) can still become an HTTP status instead of a broken stream."""
        while isinstance(event := await self._take(), StartEvent):
            pass
        self._first = event

    async def events(
        self, restarts: bool = False
    ) -> AsyncIterator[DeltaEvent | DoneEvent | StartEvent]:
        """Deltas, then the done event; raises the job's `CortexError` if it fails. With `restarts`,
        a `StartEvent` where the job started again after some output (its node was lost and the
        janitor requeued it): the output before it is void."""
        output_seen = False
        while True:
            if self._first is not None:
                event, self._first = self._first, None
            else:
                event = await self._take()
            if isinstance(event, StartEvent):
                if restarts and output_seen:
                    output_seen = False
                    yield event
                continue
            output_seen = True
            yield event
            if isinstance(event, DoneEvent):
                return

    async def final_events(self) -> AsyncIterator[DeltaEvent | DoneEvent]:
        """For an answer that is not streamed: the events of the job's last attempt, once it is done.
        A job whose node was lost is requeued by the janitor and runs again from its start; what the
        lost node had sent is void (else its text would come twice)."""
        held: list[DeltaEvent | DoneEvent] = []
        async for event in self.events(restarts=True):
            if isinstance(event, StartEvent):
                held = []
            else:
                held.append(event)
        for event in held:
            yield event

    async def _take(self) -> DeltaEvent | DoneEvent | StartEvent:
        """The next event the node sent; raises a failure (the node's error, or the bus's)."""
        item = await self._get()
        if isinstance(item, CortexError):  # the bus lost the job's events, or none came in time
            raise item
        if isinstance(item, StoredEvent):  # too large for pub/sub: the node left it in Keys.result
            item = await stored_events.resolve(self._ctx.redis, self._ctx.keys, self.id, item)
        if self.state is JobState.QUEUED:
            self._become(JobState.RUNNING)
        if isinstance(item, StartEvent):  # kept here, renderers read it; a retried job starts again
            self.prompt_tokens = item.prompt_tokens
            self.prompt_text = self.prompt_text if item.prompt_text is None else item.prompt_text
            return item
        if isinstance(item, ErrorEvent):
            self._ending = item
            raise error_from_code(item.code, item.message)
        if self._timer is not None:
            self._timer.on_event(item)
        if isinstance(item, DoneEvent):
            self._ending = item
        return item

    async def _get(self) -> Item:
        """The next item the bus heard; after `EventsMissed` (or for a resumed job), from the log."""
        if self._last is None:
            item = await self._next_heard()
            if not (isinstance(item, EventsMissed) and self.logged):
                self._taken += not isinstance(item, CortexError)
                return item
            log.warning("job=%s: %s; reading on from its event log", self.id, item.message)
            self._last, self._outage_until = b"0-0", self._outage_deadline()
        while not self._read:
            try:
                if await self._read_log():
                    continue
            except RedisError as exc:
                if self._outage_until is None or time.monotonic() > self._outage_until:
                    raise broker_error(exc, "could not read the job's events") from exc
                await asyncio.sleep(LOG_RETRY_S)
                continue
            await self._wait_for_news()
        return self._read.popleft()

    def _outage_deadline(self) -> float:
        return time.monotonic() + self._ctx.settings.redis_outage_wait_s

    async def _read_log(self) -> bool:
        """Read the log's entries after the last one read, each from where the events taken so far
        end (those heard on the bus first are not taken twice): True when there were any. Events
        missing before an entry (a Redis that lost what the node wrote, in a failover or a restart
        from its file) fail the job: the answer would have a hole."""
        log_key = self._ctx.keys.event_log(self.id)
        entries = await self._ctx.redis.xrange(log_key, min=b"(" + self._last, count=READ_COUNT)
        if not entries and not await self._ctx.redis.exists(log_key):
            raise self._log_gone()
        self._outage_until = None
        for entry_id, fields in entries:
            self._last = entry_id
            try:
                events = event_log.events(fields)
            except WireError as exc:
                self._read.append(
                    GenerationFailed(f"the node logged an event this gateway cannot read: {exc}")
                )
                continue
            at = event_log.place(fields)
            at = self._logged if at is None else at
            if at > self._taken:  # the events before it first, then the job ends
                self._read.append(
                    BrokerUnavailable(
                        f"Redis lost events {self._taken}-{at - 1} of job {self.id} after the node"
                        " sent them (a failover or a restart from its file)"
                    )
                )
                break
            self._read.extend(events[self._taken - at :])
            self._taken = max(self._taken, at + len(events))
            self._logged = at + len(events)
        return bool(entries)

    def _log_gone(self) -> CortexError:
        return BrokerUnavailable(f"the event log of job {self.id} was lost while Redis was away")

    async def _wait_for_news(self) -> None:
        """Until the node publishes again, or the link drops or comes back (then the log may hold
        news); the bus failing the job (Redis away too long) raises."""
        news = await self._next_heard()
        while True:
            if isinstance(news, EventsMissed):
                self._outage_until = self._outage_deadline()
                return
            if isinstance(news, BrokerUnavailable):
                raise news
            if self._heard.empty():
                return
            news = self._heard.get_nowait()

    async def _next_heard(self) -> Item:
        """The next item the bus heard for the job, within `request_timeout_s`; while the job is
        queued, also within its queue deadline (then it leaves the queue: `_leave_queue`). A batch
        line still unread on the queue is not silent but waiting its turn behind interactive jobs:
        it waits on (its batch's window bounds it)."""
        timeout_s = self._ctx.settings.request_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            give_up = loop.time() + timeout_s
            queued = self.state is JobState.QUEUED
            leaves = queued and self.queue_deadline is not None and self.queue_deadline < give_up
            try:
                async with asyncio.timeout_at(self.queue_deadline if leaves else give_up):
                    item = await self._heard.get()
            except TimeoutError:
                if leaves:  # its queue deadline came first
                    await self._leave_queue()  # else a node has it: its events come as any job's
                    continue
                if queued and self.waits_its_turn and await self.position() > 0:
                    continue
                raise Timeout(
                    f"no event from model {self.model} for job {self.id} in {timeout_s:g}s"
                ) from None
            self.trace.taken()
            return item

    async def _leave_queue(self) -> None:
        """Past its queue deadline: taken off the queue, and `QueueTimeout`, when no node read it
        yet (else it runs on, and its events come as any job's)."""
        self.queue_deadline = None
        redis, keys = self._ctx.redis, self._ctx.keys
        if self.entry_id and await queue.withdraw(redis, keys, self.stream, self.entry_id):
            waited_s = time.time() - self.created
            error = QueueTimeout(
                f"job {self.id} waited {waited_s:.0f}s in the queue for model {self.model} and was"
                " taken off it",
                retry_after_s=queue.RETRY_AFTER_S,
            )
            self._ending = ErrorEvent(code=error.code, message=error.message)
            raise error

    # ---- its end ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """End the job: finished or failed as the node ended it, else cancelled (withdrawn from its
        stream if no node read it yet, else stopped where it runs); then unsubscribe. Idempotent;
        runs to the end even when the caller is being cancelled (the client went away)."""
        if self.state.ended:
            return
        with anyio.CancelScope(shield=True):
            self.trace.taken()
            if isinstance(self._ending, DoneEvent):
                self._become(JobState.FINISHED)
                await self._finished(self._ending)
            elif isinstance(self._ending, ErrorEvent):
                self._become(JobState.FAILED)
                self._failed(self._ending)
            else:
                self._become(JobState.CANCELLED)
                await self._cancel()
            self._ctx.routing.ended(self.id)
            await self._unsubscribe()
            await self._drop_kept()

    async def detach(self) -> None:
        """The client went away (or this gateway is stopping): close the job, unless it may run on
        without it (`on_disconnect`). Idempotent, like `close`."""
        if self._ending is not None or self.on_disconnect == OnDisconnect.CANCEL:
            return await self.close()
        if self.state.ended:
            return
        self._become(JobState.DETACHED)
        with anyio.CancelScope(shield=True):
            await self._unsubscribe()
            if self.on_disconnect == OnDisconnect.GRACE:
                await self._ctx.departures.left(self.id)
            log.info(
                "job=%s request=%s key=%s: its client went away; the job runs on (%s)",
                self.id,
                self.request_id,
                self.caller.name,
                self.on_disconnect,
            )

    async def _finished(self, done: DoneEvent) -> None:
        self.trace.done(done)
        log.info(
            "job=%s request=%s key=%s done: %d+%d tokens, node %s, queue %.0fms prefill %.0fms decode %.0fms",
            self.id,
            self.request_id,
            self.caller.name,
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.node or "?",
            done.timings.queue_ms,
            done.timings.prefill_ms,
            done.timings.decode_ms,
        )
        if self.metered:  # the node counted them against the key's budgets (shared/usage_meter.py)
            self._ctx.metrics.key_tokens(self.caller.name, done.usage)
        if self.session and done.node:
            try:
                await self._ctx.routing.ran(self.model, self.session, done.node)
            except RedisError as exc:
                log.warning("job=%s: could not note where its session ran: %s", self.id, exc)

    def _failed(self, error: ErrorEvent) -> None:
        self.trace.failed(error.code)
        log.info(
            "job=%s request=%s key=%s failed on the node: %s: %s",
            self.id,
            self.request_id,
            self.caller.name,
            error.code,
            error.message,
        )

    async def _cancel(self) -> None:
        """Still queued: withdrawn, so no node runs it for nobody; else cancelled where it runs."""
        log.info(
            "job=%s request=%s key=%s cancelled before it finished",
            self.id,
            self.request_id,
            self.caller.name,
        )
        redis, keys = self._ctx.redis, self._ctx.keys
        try:
            if not (
                self.entry_id and await queue.withdraw(redis, keys, self.stream, self.entry_id)
            ):
                await publish(redis, keys.cancel(), self.id)
        except RedisError as exc:
            log.warning("job=%s: could not publish its cancellation: %s", self.id, exc)

    async def _drop_kept(self) -> None:
        """A job nobody can resume has no more use for its event log and stored events: they go
        now rather than expire."""
        if self.on_disconnect != OnDisconnect.CANCEL:
            return
        keys = self._ctx.keys
        try:
            await self._ctx.redis.delete(keys.event_log(self.id), keys.result(self.id))
        except RedisError as exc:
            log.warning("job=%s: could not delete its event log: %s", self.id, exc)

    async def _unsubscribe(self) -> None:
        await self._ctx.bus.unsubscribe(self._ctx.keys.events(self.id), self._heard)

    async def __aenter__(self) -> "Job":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
