"""Background responses (`background: true` on `/v1/responses`): the job runs with no client
connected, and any replica answers for it.

While it runs, the stored response is a placeholder (`ResponseStore.hold`); what `GET` answers is
folded from the job's event log: `queued`, `in_progress` with the output so far, then `completed`
/ `incomplete`, `failed` or `cancelled`. The first reader to see the job ended stores the final
response (and counts its tokens, once): a poll, a client streaming it, or the janitor, which
settles every background response whose job ended (`settle_ended`), so each is stored before its
event log expires. `cancel` takes a queued job back, or stops a running one (its slot is freed at
the node's next step), and stores the response as `cancelled` with its output so far.
"""

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.dialects.protocol.responses import Response
from gateway.dialects.render.responses import ResponseSpec, folded
from gateway.dialects.tools.parsers import parsers_for
from gateway.jobs import queue
from gateway.jobs.job import Resumable
from gateway.stores.files import visible
from gateway.stores.responses import Kept
from shared import event_log
from shared.api_keys import ANONYMOUS
from shared.errors import InvalidRequest, NotFound
from shared.redis_conn import broker_error, publish
from shared.wire import Event, WireError, ends_job

log = logging.getLogger(__name__)

READ_COUNT = 4096  # log entries per round trip


@dataclass
class LoggedJob:
    """What a response says of its job (`gateway.dialects.render.JobInfo`), from its log's record."""

    id: str
    created: int
    model: str
    prompt_tokens: int = 0
    prompt_text: str | None = None


@dataclass
class Folded:
    record: Resumable
    response: Response

    @property
    def ended(self) -> bool:
        return self.response.status not in ("queued", "in_progress")

    @property
    def kept(self) -> Kept:
        return Kept.of(self.record.spec, self.record.owner)


def job_of(response_id: str) -> str:
    return response_id.removeprefix("resp_")


async def fold(ctx, response_id: str) -> Folded | None:
    """The response as its job's event log makes it now; None without a log."""
    job = job_of(response_id)
    entries, after = [], "-"
    while batch := await ctx.redis.xrange(ctx.keys.event_log(job), min=after, count=READ_COUNT):
        entries += batch
        after = b"(" + batch[-1][0]
    if not entries or event_log.RECORD not in entries[0][1]:
        return None
    record = Resumable.loads(entries[0][1][event_log.RECORD])
    if record.dialect != "responses":
        return None
    events: list[Event] = []
    for _, fields in entries[1:]:
        try:
            events += event_log.events(fields)
        except WireError as exc:
            log.error("job=%s: an unreadable event in its log: %s", job, exc)
    parser = parsers_for(record.tools, True, job)() if record.tools else None
    response = folded(
        LoggedJob(job, record.created, record.model),
        ResponseSpec.load(record.spec["response"]),
        events,
        parser,
    )
    return Folded(record, response)


async def _finish(ctx, found: Folded) -> None:
    """Store an ended background response (the node that ended its job counted its tokens)."""
    await ctx.responses.put(found.response, found.kept)
    log.info("background response %s %s", found.response.id, found.response.status)


async def current(ctx, response_id: str, owner: str | None) -> dict[str, Any]:
    """`GET /v1/responses/{id}`: `owner`'s stored response (None: anyone's); a background one still
    pending (or a streamed one still running, never stored yet) as its job's log makes it now, stored
    once it has ended."""
    try:
        stored = await ctx.responses.read(response_id, owner)
        if stored is not None and "pending" not in stored:
            return stored["response"]
        found = await fold(ctx, response_id)
        if found is not None and not visible(found.record.owner, owner):
            found = None
        if found is None:
            if stored is None:
                raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
            return stored["response"]
        if stored is not None and found.ended:
            await _finish(ctx, found)
    except RedisError as exc:
        raise broker_error(exc, "could not read the response") from exc
    return found.response.model_dump(mode="json")


async def conversation(ctx, response_id: str, owner: str | None) -> list[dict[str, Any]]:
    """The conversation `previous_response_id` continues, if it is `owner`'s (a background response is
    settled first)."""
    if await ctx.redis.zscore(ctx.keys.background_responses(), response_id) is not None:
        await current(ctx, response_id, owner)
    return await ctx.responses.conversation(response_id, owner)


async def cancel(ctx, caller, response_id: str) -> dict[str, Any]:
    """`POST /v1/responses/{id}/cancel`: stop a background response that has not ended."""
    store = ctx.responses
    stored = await store.read(response_id, caller.owner)
    if stored is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    if not stored["response"].get("background"):
        raise InvalidRequest(
            "Only responses created with background: true can be cancelled.", param="response_id"
        )
    if "pending" not in stored:
        return stored["response"]  # it ended already
    found = await fold(ctx, response_id)
    pending, job = stored["pending"], job_of(response_id)
    # still queued: nobody will read it
    await queue.withdraw(ctx.redis, ctx.keys, pending["stream"], pending["entry"])
    await publish(ctx.redis, ctx.keys.cancel(), job)  # running: the node stops it at its next step
    if found is not None and found.ended:
        await _finish(ctx, found)
        return found.response.model_dump(mode="json")
    response = (
        found.response if found else Response.model_validate(stored["response"])
    ).model_copy(update={"status": "cancelled"})
    await store.put(response, found.kept if found else Kept([], stored.get("owner", ANONYMOUS)))
    log.info("background response %s cancelled", response_id)
    return response.model_dump(mode="json")


async def settle_ended(ctx) -> None:
    """For the janitor: store every background response whose job has ended (or whose log is gone)."""
    for raw in await ctx.redis.zrange(ctx.keys.background_responses(), 0, -1):
        response_id = raw.decode()
        last = await ctx.redis.xrevrange(ctx.keys.event_log(job_of(response_id)), count=1)
        try:
            ended = not last or bool((said := event_log.events(last[0][1])) and ends_job(said))
        except WireError:
            ended = True
        if ended:
            await _settle(ctx, response_id)


async def _settle(ctx, response_id: str) -> None:
    store = ctx.responses
    stored = await store.read(response_id, None)
    if stored is None or "pending" not in stored:  # deleted, or stored by whoever saw it end
        await ctx.redis.zrem(ctx.keys.background_responses(), response_id)
        return
    found = await fold(ctx, response_id)
    if found is not None:
        await _finish(ctx, found)
        return
    error = {
        "code": "expired",
        "message": "the job's events expired before it ended (stream_retention_s)",
    }
    failed = Response.model_validate(stored["response"]).model_copy(
        update={"status": "failed", "error": error}
    )
    await store.put(failed, Kept([], stored.get("owner", ANONYMOUS)))
    log.warning("background response %s failed: its job's event log is gone", response_id)
