"""Resuming a job's stream, through any gateway replica, from its event log (`shared.event_log`).

A client that lost its connection asks for the job again (`GET /v1/<dialect>/{id}?stream=true`)
with the number of the last frame it saw (`starting_after`, or the SSE standard's `Last-Event-ID`
header). The gateway listens on the job's channel first (so the job counts as read: see
gateway/jobs/departures.py; and every PUBLISH of the node says a new log entry is there), then reads the
log from its start: the record of the request, then the events. It renders them as the first
stream did (the same renderer, the same tool-call ids) and sends the frames after the client's
last, then each new entry as it comes, until the job ends. Entry ids order the events, so none is
sent twice and none is missed, however the reading and the node's writing interleave.
"""

import logging
from collections import deque
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Query
from redis.exceptions import RedisError
from starlette.requests import Request

from gateway.bus.listeners import Item
from gateway.dialects.tools.parsers import no_parser, parsers_for
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.jobs.job import Job, OnDisconnect, Resumable
from shared import event_log
from shared.errors import BrokerUnavailable, GenerationFailed, InvalidRequest, NotFound
from shared.redis_conn import broker_error
from shared.wire import WireError

log = logging.getLogger(__name__)

READ_COUNT = 512  # log entries read per round trip
BACKGROUND_HEADER = "x-cortex-background"  # "true": a streamed chat completion or message runs on without its client


@dataclass
class ResumePoint:
    stream: bool  # the client asked for the stream (`stream=true`)
    after: int  # the number of the last frame it saw; -1: from the start


def resume_point(
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> ResumePoint:
    """Where a resumed stream starts: after `starting_after`, else after `Last-Event-ID`."""
    if starting_after is not None:
        return ResumePoint(stream, starting_after)
    if last_event_id is None or not last_event_id.strip():
        return ResumePoint(stream, -1)
    try:
        return ResumePoint(stream, int(last_event_id))
    except ValueError:
        raise InvalidRequest(
            f"Last-Event-ID: {last_event_id[:40]!r} is not a frame number (the `id:` of a frame)",
            param="Last-Event-ID",
        ) from None


ResumeAt = Annotated[ResumePoint, Depends(resume_point)]


def on_disconnect(request: Request) -> OnDisconnect:
    """A streamed chat completion, completion or message with `x-cortex-background: true` runs on
    when its client goes away; else it is cancelled after `disconnect_grace_s`."""
    background = request.headers.get(BACKGROUND_HEADER, "").strip().lower() in ("1", "true", "yes")
    return OnDisconnect.KEEP if background else OnDisconnect.GRACE


class ResumedJob(Job):
    """A job rendered again from its event log: `_get` reads the log after the last entry it read,
    waiting for the node's next PUBLISH (on the job's channel) when it has read it all."""

    def __init__(
        self,
        ctx: JobContext,
        job: str,
        record: Resumable,
        record_id: bytes,
        queue,
        caller: Caller,
        after: int,
    ):
        parsers = parsers_for(record.tools, True, job) if record.tools else no_parser
        super().__init__(
            ctx,
            job,
            record.model,
            queue,
            caller,
            parsers=parsers,
            metered=record.metered,
            prompt_text=record.prompt_text,
            on_disconnect=record.on_disconnect,
            created=record.created,
            timed=False,
        )
        self.record, self.after = record, after
        self._log = ctx.keys.event_log(job)
        self._last = record_id
        self._read: deque[Item] = deque()

    async def _get(self) -> Item:
        while not self._read:
            if not await self._read_log():
                await self._wait_for_news()
        return self._read.popleft()

    async def _read_log(self) -> bool:
        try:
            entries = await self._ctx.redis.xrange(
                self._log, min=b"(" + self._last, count=READ_COUNT
            )
            if not entries and not await self._ctx.redis.exists(self._log):
                raise NotFound(f"the event log of job {self.id} expired while it was read")
        except RedisError as exc:
            raise broker_error(exc, "could not read the job's events") from exc
        for entry_id, fields in entries:
            self._last = entry_id
            try:
                self._read.extend(event_log.events(fields))
            except WireError as exc:
                self._read.append(
                    GenerationFailed(f"the node logged an event this gateway cannot read: {exc}")
                )
        return bool(entries)

    async def _wait_for_news(self) -> None:
        """Until the node publishes again (or the bus fails: Redis went away)."""
        news = await super()._get()  # a Timeout when nothing comes within request_timeout_s
        while True:
            if isinstance(
                news, BrokerUnavailable
            ):  # the bus lost Redis: what it missed is in the log, not here
                raise news
            if self._heard.empty():
                return
            news = self._heard.get_nowait()


async def resume(
    ctx: JobContext, caller: Caller, dialect: str, given_id: str, prefix: str, at: ResumePoint
) -> ResumedJob:
    """The job behind `given_id` (an API object's id: `prefix` + job id), for its owner, ready to
    stream again after frame `at.after`; 404 for a job that is not (or no longer) there, was made
    through another endpoint, or belongs to another key."""
    job = given_id.removeprefix(prefix)
    channel = ctx.keys.events(job)
    queue = await ctx.bus.subscribe(
        channel
    )  # before reading the log: nothing the node adds is missed
    try:
        first = await ctx.redis.xrange(ctx.keys.event_log(job), count=1)
        record = (
            Resumable.loads(first[0][1][event_log.RECORD])
            if first and event_log.RECORD in first[0][1]
            else None
        )
        if record is None or record.dialect != dialect or record.owner != caller.name:
            raise NotFound(
                f"No stream '{given_id}' to resume: none was made here for this key, or it ended more "
                f"than stream_retention_s ({ctx.settings.stream_retention_s}s) ago",
                param="id",
            )
        if not at.stream:
            raise InvalidRequest(
                "Cortex keeps a job's events to stream them again: add stream=true", param="stream"
            )
    except BaseException as exc:
        await ctx.bus.unsubscribe(channel, queue)
        if isinstance(exc, RedisError):
            raise broker_error(exc, "could not read the job's events") from exc
        raise
    log.info("job=%s key=%s resumed after frame %d", job, caller.name, at.after)
    return ResumedJob(ctx, job, record, first[0][0], queue, caller, at.after)
