"""From a request to a job on the streams: `admit` (the model exists and is of the right kind, the
caller may use it and is within its limits), `admit_and_submit` (every generation request's one
way in: a route's, a resumed stream's first submission, a batch line's) and `submit`, which
subscribes to the job's event channel (confirmed by Redis) and only then XADDs the job to its
stream (or its caller's waiting room: fair shares, gateway/jobs/queue.py), unless too many jobs
wait already (`queue_max_waiting`: 503 at once); every job gets its event log (`shared.event_log`)
first: a client may resume one that is `resumable`, and any job reads on from it when the bus's
link drops (one nobody can resume deletes it when it ends). An interactive job carries its queue
deadline (`queue_timeout_s` or the `x-cortex-queue-timeout` header). The job that comes back is
followed to its end by gateway/jobs/job.py.

Words: a job's `job_class` is `interactive` (API requests) or `batch` (batch lines); a request's
`priority` (lower is sooner) picks its band within that class (shared/queues.py)."""

import asyncio
import logging
import time
import uuid
from contextvars import ContextVar
from typing import Protocol

import anyio
from redis.exceptions import RedisError

from gateway.dialects.tools import grammars
from gateway.dialects.tools.parsers import Parsers, no_parser, parser_name, parsers_for
from gateway.fleet.routing import SHARED
from gateway.jobs import queue
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.jobs.images import ImageLimits, take_images
from gateway.jobs.job import Job, OnDisconnect, Resumable
from gateway.tracing import JobTrace, request_id_var, span
from shared import event_log, prefix_marks, queues
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest, QueueFull, WrongModelKind
from shared.redis_conn import broker_error
from shared.wire import GenerationRequest, PoolingRequest, StreamEntry, pack

log = logging.getLogger(__name__)

session_header_var: ContextVar[str] = ContextVar("session_header", default="")  # x-cortex-session


def new_job_id() -> str:
    return uuid.uuid4().hex


def session_hint(body) -> str:
    """The request's session, as its dialect names one: OpenAI's `prompt_cache_key` or `user`,
    Anthropic's `metadata.user_id`, or the `x-cortex-session` header; '' for none."""
    metadata = getattr(body, "metadata", None)
    return (
        getattr(body, "prompt_cache_key", None)
        or getattr(body, "user", None)
        or getattr(metadata, "user_id", None)
        or session_header_var.get()
    )


async def _unsubscribe(ctx: JobContext, channel: str, subscribing: asyncio.Future) -> None:
    """Undo `subscribing` (a task of `bus.subscribe`) for a job that was not queued: stop it
    if it has not finished, else unsubscribe what it subscribed."""
    if not subscribing.done():
        subscribing.cancel()  # bus.subscribe unsubscribes what it began
    try:
        heard = await subscribing
    except BaseException:  # cancelled, or it failed: nothing is subscribed
        return
    await ctx.bus.unsubscribe(channel, heard)


async def submit(
    ctx: JobContext,
    request: GenerationRequest | PoolingRequest,
    caller: Caller,
    *,
    job_class: str = "interactive",
    streaming: bool = False,
    keep_alive_s: float | None = None,
    priority: int | None = None,
    parsers: Parsers = no_parser,
    resumable: Resumable | None = None,
    session: str = "",
) -> Job:
    """Subscribe to the job's events, then enqueue it on the stream of its class (`job_class`:
    interactive | batch) and band (the request's `priority`, lower is sooner; shared/queues.py)
    for `caller`, with its event log first when it is `resumable`; the caller must `close()` (or
    `detach()`) the job. It goes to a node's own stream where `ctx.routing` says (its cache holds
    the prefix, or its `session` ran there last); an embedding or rerank job (a `PoolingRequest`)
    always to the model's shared streams."""
    generation = isinstance(request, GenerationRequest)
    channel = ctx.keys.events(request.job)
    try:  # before subscribing: a request that cannot travel leaves nothing behind
        body = pack(request)
    except (OverflowError, ValueError, TypeError) as exc:  # a tool schema with a huge integer
        raise InvalidRequest(
            f"the request cannot be sent to a node ({exc}); integers must fit in 64 bits"
        ) from None
    trace = JobTrace(request.job, request.model)
    metered = caller.key is not None and request.kind != "count"  # counting tokens uses none
    created = int(time.time())
    echoed = generation and request.echo and isinstance(request.prompt, str)
    prompt_text = request.prompt if echoed else None
    entry = StreamEntry(
        job=request.job,
        kind=request.kind,
        model=request.model,
        job_class=job_class,
        max_tokens=(request.sampling.max_tokens or 0) if generation else 0,
        submitted_ms=int(time.time() * 1000),
        channel=channel,
        request_id=request_id_var.get(),
        streaming=int(
            streaming or resumable is not None
        ),  # a resumable job's client may have seen tokens
        keep_alive_s=keep_alive_s,
        api_key=caller.name if metered else None,
        tenant=caller.name,
        traceparent=trace.traceparent,
        body=body,
    )
    band = queues.band(priority)
    # confirmed on the bus's link while the job is routed and its log made (each a round trip here)
    subscribing = asyncio.ensure_future(ctx.bus.subscribe(channel))
    try:
        route = await ctx.routing.route(request, session, job_class, band) if generation else SHARED
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _unsubscribe(ctx, channel, subscribing)
        raise
    stream = (
        ctx.keys.node_jobs(request.model, route.node, job_class, band)
        if route.node
        else ctx.keys.jobs(request.model, job_class, band)
    )
    log_key = ctx.keys.event_log(request.job)
    try:
        async with ctx.redis.pipeline(transaction=False) as pipe:
            record = resumable or Resumable("", on_disconnect=OnDisconnect.CANCEL)
            record.owner, record.metered, record.model = caller.name, metered, request.model
            record.created, record.prompt_text = created, prompt_text
            pipe.xadd(log_key, {event_log.RECORD: record.dumps()})
            retention_s = ctx.settings.stream_retention_s + int(ctx.settings.request_timeout_s)
            pipe.expire(log_key, retention_s)
            pipe.hincrby(ctx.keys.routing(request.model), route.outcome, 1)
            await pipe.execute()
        heard = await subscribing  # a subscription that failed leaves the log to its expiry
        stream, entry_id = await queue.enqueue(
            ctx.redis,
            ctx.keys,
            stream,
            entry.to_fields(),
            tenant=caller.name,
            max_waiting=ctx.settings.queue_max_waiting if job_class == "interactive" else 0,
            maxlen=ctx.settings.stream_maxlen,
        )
    except BaseException as exc:
        trace.taken()
        with anyio.CancelScope(shield=True):
            await _unsubscribe(ctx, channel, subscribing)
            if isinstance(exc, QueueFull):  # nothing of the job stays behind
                async with ctx.redis.pipeline(transaction=False) as pipe:
                    pipe.hincrby(ctx.keys.routing(request.model), route.outcome, -1)
                    pipe.delete(log_key)
                    await pipe.execute()
        if isinstance(exc, RedisError):
            raise broker_error(exc, f"could not enqueue the job on {stream}") from exc
        raise
    job = Job(
        ctx,
        request.job,
        request.model,
        heard,
        caller,
        parsers=parsers,
        metered=metered,
        prompt_text=prompt_text,
        on_disconnect=resumable.on_disconnect if resumable else OnDisconnect.CANCEL,
        created=created,
        trace=trace,
        session=session,
        streamed=bool(entry.streaming),
    )
    job.stream, job.entry_id, job.logged = stream, entry_id, True
    job.waits_its_turn = job_class == "batch"
    if job_class == "interactive" and (wait_s := queue.timeout_s(ctx.settings)) > 0:
        job.queue_deadline = asyncio.get_running_loop().time() + wait_s
    trace.queued(stream, entry_id)
    ctx.bus.track(channel, stream, entry_id)  # while queued, it may wait out a Redis restart
    ctx.bus.logged(channel)  # once running, a dropped link reads on from its log
    log.info(
        "job=%s request=%s key=%s queued on %s as %s",
        job.id,
        job.request_id,
        caller.name,
        stream,
        entry_id,
    )
    return job


class ApiRequest(Protocol):
    """What every dialect's request model offers (gateway/dialects/protocol)."""

    model: str
    stream: bool

    @property
    def uses_tools(self) -> bool: ...

    @property
    def constraint(self) -> grammars.Constraint: ...

    def to_generation_request(self, job: str, model: str) -> GenerationRequest: ...


_KINDS = {  # a profile's kind -> (what the model is, what it serves)
    "generate": ("a chat model", "chat, completions and messages"),
    "embedding": ("an embedding model", "/v1/embeddings"),
    "rerank": ("a rerank model", "/v1/rerank and /v1/score"),
}


async def admit(
    ctx: JobContext, model: str, kind: str | None, caller: Caller, job_class: str
) -> ModelProfile:
    """The profile of `model` (404 if unknown), checked that the caller's key may use it (404/403),
    that it is of `kind` (400 when it serves something else: chat on an embedding model; None: any
    kind, as for a request that only loads the model) and that the key is within its limits (429;
    a batch line within its token budgets, gateway/jobs/limits.py)."""
    profile = ctx.catalog.resolve(model)
    caller.check_may_use(profile, ctx.catalog.adapter_of(model))
    if kind is not None and profile.kind != kind:
        (named, serves), (_, asked) = _KINDS[profile.kind], _KINDS[kind]
        raise WrongModelKind(f"{model} is {named}: it serves {serves}, not {asked}", param="model")
    if caller.key is not None:
        await ctx.limiter.admit(caller.key, job_class)
    return profile


async def submit_request(
    ctx: JobContext,
    body: ApiRequest,
    caller: Caller,
    *,
    job_class: str = "interactive",
    resumable: Resumable | None = None,
) -> Job:
    """`admit_and_submit`, waiting out a short Redis outage (gateway/bus/outage.py)."""
    return await ctx.outage.through(
        lambda: admit_and_submit(ctx, body, caller, job_class=job_class, resumable=resumable)
    )


async def admit_and_submit(
    ctx: JobContext,
    body: ApiRequest,
    caller: Caller,
    *,
    job_class: str = "interactive",
    resumable: Resumable | None = None,
) -> Job:
    """The one way from an API request (a route's, or a batch line's) to a generation job: admit it
    (`admit`: the model exists and generates, the key may use it and is within its limits), build
    the generation request with its grammar (forced tool calls, JSON output) in the model's tool
    format and its images checked and carried in the job (400 for a bad one, or any for a
    text-only model), make sure a live node serves or loads the model (503 when none can), and
    submit. The job carries the tool-call parsers its response is rendered with (seeded by its id, so a resumed stream
    names the same calls); a `resumable` one keeps its events for clients that resume it."""
    with span("admission"):
        profile = await admit(ctx, body.model, "generate", caller, job_class)
        tool_format = parser_name(profile)
        request = body.to_generation_request(new_job_id(), profile.id)
        adapter = ctx.catalog.adapter_of(body.model)
        if adapter is not None:  # runs on its base's streams
            request.adapter, request.adapter_source = adapter.id, adapter.adapter
        request.cache_salt = prefix_marks.salt(
            ctx.settings.prefix_cache_scope,
            caller.name if caller.key else None,
            getattr(body, "cache_salt", None),
        )
        request.sampling.grammar = grammars.grammar(body.constraint, tool_format)
        await take_images(request, ImageLimits.of(ctx.settings), vision=profile.vision)
        ctx.routing.prepare(request)
        hint = session_hint(body) if ctx.settings.routing != "none" else ""
    with span("placement"):
        await ctx.placer.ensure_placed(profile)
    if resumable is not None:
        resumable.tools = tool_format if body.uses_tools else None
    return await submit(
        ctx,
        request,
        caller,
        job_class=job_class,
        streaming=bool(body.stream),
        keep_alive_s=getattr(body, "keep_alive_s", None),
        priority=getattr(body, "priority", None),
        parsers=parsers_for(tool_format, body.uses_tools, request.job),
        resumable=resumable,
        session=prefix_marks.session(caller.name, hint) if hint else "",
    )
