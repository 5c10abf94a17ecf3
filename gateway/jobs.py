"""Submit a job and follow it to its end.

`submit` subscribes to the job's event channel (confirmed by Redis) and only then XADDs the
job to `cortex:jobs:{model}`; a job a client may resume gets its event log (`shared.event_log`)
in the same round trip, first. `Job.events()` yields its deltas up to the `done` event; an error
event raises the typed error the node reported. `Job.close()` always runs (the routes see to
it): a job that did not finish is cancelled on `cortex:cancel`, and the subscription is dropped,
so nothing is left behind but the stream entry the nodes acknowledge. When the client went away,
`Job.detach()` runs instead: its job's `on_disconnect` says whether it is cancelled at once, after
`disconnect_grace_s` unless someone resumes it (gateway/detach.py), or never (`background`).
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import anyio
from redis.exceptions import RedisError

from gateway import job_queue
from gateway.auth import Caller
from gateway.context import GatewayContext
from gateway.images import ImageLimits, take_images
from gateway.listeners import Item
from gateway.request_id import request_id_var
from gateway.routing import SHARED, session_hint
from gateway.tools import grammars
from gateway.tools.parsers import Parsers, no_parser, parser_name, parsers_for
from gateway.tracing import JobTrace, span
from shared import event_log, prefix_marks, queues
from shared.catalog import ModelProfile
from shared.errors import CortexError, InvalidRequest, Timeout, WrongModelKind, error_from_code
from shared.redis_conn import broker_error, publish
from shared.wire import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    PoolingRequest,
    StartEvent,
    StreamEntry,
    pack,
)

log = logging.getLogger(__name__)


def new_job_id() -> str:
    return uuid.uuid4().hex


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
        ctx: GatewayContext,
        job: str,
        model: str,
        queue: asyncio.Queue[Item],
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
    ):
        self.id = job
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.request_id = request_id_var.get()
        self.caller = caller  # whose job it is: its tokens count against the key's budgets
        self.parsers = (
            parsers  # a fresh tool-call parser per choice of the response, or None without tools
        )
        self.metered = metered
        self.on_disconnect = on_disconnect
        self.after = (
            -1
        )  # the number of the last frame the client has seen (a resumed stream goes on after it)
        self._ctx = ctx
        self._queue = queue
        self._first: DeltaEvent | DoneEvent | None = None
        self.prompt_tokens = 0  # the prompt's length, once the node's start event told it
        self._output_seen = False  # an event after the (last) start event came
        self.prompt_text = prompt_text  # the prompt's text when the request asked to echo it
        self.finished = False  # the node ended it (done or error): nothing to cancel
        self.closed = False
        self.stream = (
            ""  # the job stream it was queued on, and its entry id there ("": not known here)
        )
        self.entry_id = ""
        self._timer = ctx.metrics.request(self.model, time.monotonic()) if timed else None
        self.trace = trace or JobTrace(
            job, model
        )  # its part of the request's trace (gateway/tracing.py)
        self.session = (
            session  # its session's name (`shared.prefix_marks.session`), for routing its next turn
        )

    async def first_event(self) -> None:
        """Wait for the first event, so that an error before any output (context too long, the
        model failed to load) can still become an HTTP status instead of a broken stream."""
        self._first = await self._next()

    async def events(
        self, restarts: bool = False
    ) -> AsyncIterator[DeltaEvent | DoneEvent | StartEvent]:
        """Deltas, then the done event; raises the job's `CortexError` if it fails. With `restarts`,
        a `StartEvent` where the job started again after some output (its node was lost and the
        janitor requeued it): the output before it is void."""
        while True:
            if self._first is not None:
                event, self._first = self._first, None
            else:
                event = await self._next(restarts)
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

    async def _next(self, restarts: bool = False) -> DeltaEvent | DoneEvent | StartEvent:
        item = await self._get()
        while isinstance(
            item, StartEvent
        ):  # kept here, renderers read it; a retried job starts again
            self.prompt_tokens = item.prompt_tokens
            self.prompt_text = self.prompt_text if item.prompt_text is None else item.prompt_text
            if restarts and self._output_seen:
                self._output_seen = False
                return item
            item = await self._get()
        self._output_seen = True
        if isinstance(item, CortexError):
            raise item
        if isinstance(item, ErrorEvent):
            self.finished = True
            self.trace.failed(item.code)
            log.info(
                "job=%s request=%s key=%s failed on the node: %s: %s",
                self.id,
                self.request_id,
                self.caller.name,
                item.code,
                item.message,
            )
            raise error_from_code(item.code, item.message)
        if self._timer is not None:
            self._timer.on_event(item)
        if isinstance(item, DoneEvent):
            self.finished = True
            self.trace.done(item)
            log.info(
                "job=%s request=%s key=%s done: %d+%d tokens, node %s, queue %.0fms prefill %.0fms decode %.0fms",
                self.id,
                self.request_id,
                self.caller.name,
                item.usage.prompt_tokens,
                item.usage.completion_tokens,
                item.node or "?",
                item.timings.queue_ms,
                item.timings.prefill_ms,
                item.timings.decode_ms,
            )
            if self.session and item.node:
                try:
                    await self._ctx.routing.ran(self.model, self.session, item.node)
                except RedisError as exc:
                    log.warning("job=%s: could not note where its session ran: %s", self.id, exc)
            if (
                self.metered
            ):  # the node counted them against the key's budgets (shared/usage_meter.py)
                self._ctx.metrics.key_tokens(self.caller.name, item.usage)
        return item

    async def _get(self) -> Item:
        timeout_s = self._ctx.settings.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                item = await self._queue.get()
        except TimeoutError:
            raise Timeout(
                f"no event from model {self.model} for job {self.id} in {timeout_s:g}s"
            ) from None
        self.trace.taken()
        return item

    async def close(self) -> None:
        """Cancel the job unless it finished, and unsubscribe. Idempotent; runs to the end even
        when the caller is being cancelled (the client went away)."""
        if self.closed:
            return
        self.closed = True
        self.trace.taken()
        with anyio.CancelScope(shield=True):
            if not self.finished:
                log.info(
                    "job=%s request=%s key=%s cancelled before it finished",
                    self.id,
                    self.request_id,
                    self.caller.name,
                )
                try:  # still queued: withdrawn, so no node runs it for nobody; else cancelled where it runs
                    if not (
                        self.entry_id
                        and await job_queue.withdraw(self._ctx, self.stream, self.entry_id)
                    ):
                        await publish(self._ctx.redis, self._ctx.keys.cancel(), self.id)
                except RedisError as exc:
                    log.warning("job=%s: could not publish its cancellation: %s", self.id, exc)
            self._ctx.routing.ended(self.id)
            await self._unsubscribe()

    async def detach(self) -> None:
        """The client went away (or this gateway is stopping): close the job, unless it may run on
        without it (`on_disconnect`). Idempotent, like `close`."""
        if self.finished or self.on_disconnect == OnDisconnect.CANCEL:
            return await self.close()
        if self.closed:
            return
        self.closed = True
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

    async def _unsubscribe(self) -> None:
        await self._ctx.router.unsubscribe(self._ctx.keys.events(self.id), self._queue)

    async def __aenter__(self) -> "Job":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


async def submit(
    ctx: GatewayContext,
    request: GenerationRequest | PoolingRequest,
    caller: Caller,
    *,
    priority: str = "interactive",
    stream: bool = False,
    keep_alive_s: float | None = None,
    rank: int | None = None,
    parsers: Parsers = no_parser,
    resumable: Resumable | None = None,
    session: str = "",
) -> Job:
    """Subscribe to the job's events, then enqueue it on the stream of its priority class
    (`priority`: interactive | batch) and band (`rank`: the request's `priority`, lower is
    sooner; see shared/queues.py) for `caller`, with its event log first when it is `resumable`;
    the caller must `close()` (or `detach()`) the job. It goes to a node's own stream where
    `ctx.routing` says (its cache holds the prefix, or its `session` ran there last); an embedding
    or rerank job (a `PoolingRequest`) always to the model's shared streams."""
    generation = isinstance(request, GenerationRequest)
    channel = ctx.keys.events(request.job)
    try:  # before subscribing: a request that cannot travel leaves nothing behind
        body = pack(request)
    except (
        OverflowError,
        ValueError,
        TypeError,
    ) as exc:  # free-form JSON (a tool schema) with a huge integer
        raise InvalidRequest(
            f"the request cannot be sent to a node ({exc}); integers must fit in 64 bits"
        ) from None
    trace = JobTrace(request.job, request.model)
    metered = caller.key is not None and request.kind != "count"  # counting tokens uses none
    entry = StreamEntry(
        job=request.job,
        kind=request.kind,
        model=request.model,
        priority=priority,
        max_tokens=(request.sampling.max_tokens or 0) if generation else 0,
        submitted_ms=int(time.time() * 1000),
        reply=channel,
        request_id=request_id_var.get(),
        stream=int(
            stream or resumable is not None
        ),  # a resumable job's client may have seen tokens
        keep_alive_s=keep_alive_s,
        key=caller.name if metered else None,
        traceparent=trace.traceparent,
        body=body,
    )
    band = queues.band(rank)
    route = await ctx.routing.route(request, session, priority, band) if generation else SHARED
    stream = (
        ctx.keys.node_jobs(request.model, route.node, priority, band)
        if route.node
        else ctx.keys.jobs(request.model, priority, band)
    )
    job = Job(
        ctx,
        request.job,
        request.model,
        await ctx.router.subscribe(channel),
        caller,
        parsers=parsers,
        metered=metered,
        prompt_text=request.prompt
        if generation and request.echo and isinstance(request.prompt, str)
        else None,
        on_disconnect=resumable.on_disconnect if resumable else OnDisconnect.CANCEL,
        trace=trace,
        session=session,
    )
    try:
        async with ctx.redis.pipeline(transaction=False) as pipe:
            if resumable is not None:
                resumable.owner, resumable.metered, resumable.model = (
                    caller.name,
                    metered,
                    request.model,
                )
                resumable.created, resumable.prompt_text = job.created, job.prompt_text
                log_key = ctx.keys.event_log(request.job)
                pipe.xadd(log_key, {event_log.RECORD: resumable.dumps()})
                pipe.expire(
                    log_key, ctx.settings.stream_retention_s + int(ctx.settings.request_timeout_s)
                )
            pipe.hincrby(ctx.keys.routing(request.model), route.outcome, 1)
            pipe.xadd(
                stream, entry.to_fields(), maxlen=ctx.settings.stream_maxlen, approximate=True
            )
            entry_id = (await pipe.execute())[-1]
    except BaseException as exc:
        trace.taken()
        with anyio.CancelScope(shield=True):
            await job._unsubscribe()
        if isinstance(exc, RedisError):
            raise broker_error(exc, f"could not enqueue the job on {stream}") from exc
        raise
    job.stream, job.entry_id = stream, entry_id.decode()
    trace.queued(stream, job.entry_id)
    ctx.router.track(channel, stream, job.entry_id)  # while queued, it may wait out a Redis restart
    log.info(
        "job=%s request=%s key=%s queued on %s as %s",
        job.id,
        job.request_id,
        caller.name,
        stream,
        job.entry_id,
    )
    return job


class ApiRequest(Protocol):
    """What every dialect's request model offers (gateway/protocol)."""

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
    ctx: GatewayContext, model: str, kind: str, caller: Caller, priority: str
) -> ModelProfile:
    """The profile of `model` (404 if unknown), checked that the caller's key may use it (404/403),
    that it is of `kind` (400 when it serves something else: chat on an embedding model) and, for
    interactive requests, is within its limits (429; batch lines are not rate limited)."""
    profile = ctx.catalog.resolve(model)
    caller.check_may_use(profile)
    if profile.kind != kind:
        (named, serves), (_, asked) = _KINDS[profile.kind], _KINDS[kind]
        raise WrongModelKind(f"{model} is {named}: it serves {serves}, not {asked}", param="model")
    if caller.key is not None and priority == "interactive":
        await ctx.limiter.admit(caller.key)
    return profile


async def submit_request(
    ctx: GatewayContext,
    body: ApiRequest,
    caller: Caller,
    *,
    priority: str = "interactive",
    resumable: Resumable | None = None,
) -> Job:
    """`admit_and_submit`, waiting out a short Redis outage (gateway/outage.py)."""
    return await ctx.outage.through(
        lambda: admit_and_submit(ctx, body, caller, priority=priority, resumable=resumable)
    )


async def admit_and_submit(
    ctx: GatewayContext,
    body: ApiRequest,
    caller: Caller,
    *,
    priority: str = "interactive",
    resumable: Resumable | None = None,
) -> Job:
    """The one way from an API request (a route's, or a batch line's) to a generation job: admit it
    (`admit`: the model exists and generates, the key may use it and is within its limits), build
    the generation request with its grammar (forced tool calls, JSON output) in the model's tool
    format and its images checked and carried in the job (400 for a bad one, or any for a
    text-only model), make sure a live node serves or loads the model (503 when none can), and
    submit. The job carries
    the tool-call parsers its response is rendered with (seeded by its id, so a resumed stream
    names the same calls); a `resumable` one keeps its events for clients that resume it."""
    with span("admission"):
        profile = await admit(ctx, body.model, "generate", caller, priority)
        tool_format = parser_name(profile)
        request = body.to_generation_request(new_job_id(), profile.id)
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
        priority=priority,
        stream=bool(body.stream),
        keep_alive_s=getattr(body, "keep_alive_s", None),
        rank=getattr(body, "priority", None),
        parsers=parsers_for(tool_format, body.uses_tools, request.job),
        resumable=resumable,
        session=prefix_marks.session(caller.name, hint) if hint else "",
    )
