"""OpenAI Responses API: `POST /v1/responses` (stream and not, `background`), `GET` (streamed
again with `stream=true&starting_after=N`), `DELETE`, `GET .../input_items` and `POST .../cancel` of
`/v1/responses/{id}`. A response is stored (`store`, default true), for the key that made it only,
so that a later request can continue from it with `previous_response_id`."""

from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from gateway.dialects.gather import gather_choices
from gateway.dialects.protocol.responses import (
    ResponseCreateParams,
    ResponseDeleted,
    ResponseErrorEvent,
    ResponseItemList,
    ResponseStreamEvent,
)
from gateway.dialects.render.responses import (
    ResponseSpec,
    response,
    response_events,
    response_object,
)
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs import background, sse
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.job import Job, OnDisconnect, Resumable
from gateway.jobs.resume import ResumeAt, resume
from gateway.jobs.streaming import log, stream_job
from gateway.jobs.submit import submit_request
from gateway.stores.responses import Kept, ResponseStore
from shared.errors import CortexError

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponseCreateParams, ctx: Ctx, request: Request, caller: CallerDep
) -> Response:
    store, spec = ctx.responses, ResponseSpec.of(body)
    if body.previous_response_id:
        previous_id = body.previous_response_id
        body.continue_from(
            await ctx.outage.through(
                lambda: background.conversation(ctx, previous_id, caller.owner)
            )
        )
    kept = (
        Kept(body.conversation, caller.name, body.input_items) if body.store is not False else None
    )
    resumable = Resumable(
        "responses",
        {
            "response": spec.dump(),
            "conversation": kept and kept.conversation,
            "input": kept and kept.input,
        },
        OnDisconnect.KEEP if body.background else OnDisconnect.GRACE,
    )
    job = await submit_request(
        ctx, body, caller, resumable=resumable if body.stream or body.background else None
    )
    parser, headers = job.parsers(), _warning(job, body)
    if body.background:
        queued = response_object(job, spec, [], None, None, status="queued")
        await store.hold(queued, job.stream, job.entry_id, caller.name)
        if not body.stream:
            await job.detach()
            return JSONResponse(queued.model_dump(mode="json"), headers=headers)
    if body.stream:
        return await stream_job(
            request, job, _events(job, spec, parser, store, kept), frames=_frames, headers=headers
        )
    async with job:
        gathered = await unless_disconnected(request, gather_choices(job.final_events(), 1))
    answer = response(job, spec, gathered.choices[0], gathered.usage, parser)
    if kept is not None:
        await store.put(answer, kept)
    return JSONResponse(answer.model_dump(mode="json"), headers=headers)


def _events(job: Job, spec: ResponseSpec, parser, store: ResponseStore, kept: Kept | None):
    events = response_events(job, spec, job.events(), parser)
    return events if kept is None else store.kept_at_the_end(events, kept)


def _warning(job: Job, body: ResponseCreateParams) -> dict[str, str]:
    """A `Warning` header (and a log line) naming the tools the model was not offered."""
    warning = body.offer.warning
    if warning is None:
        return {}
    log.info("job=%s request=%s %s", job.id, job.request_id, warning)
    return {
        "Warning": f'299 cortex "{warning}"'
    }  # tool types and names only: no quotes, nothing beyond ASCII


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: str, ctx: Ctx, request: Request, caller: CallerDep, at: ResumeAt
) -> Response:
    if not at.stream:
        return JSONResponse(await background.current(ctx, response_id, caller.owner))
    job = await resume(ctx, caller, "responses", response_id, "resp_", at)
    spec = ResponseSpec.load(job.record.spec["response"])
    kept = (
        Kept.of(job.record.spec, job.record.owner)
        if job.record.spec["conversation"] is not None
        else None
    )
    events = _events(job, spec, job.parsers(), ctx.responses, kept)
    return await stream_job(request, job, events, frames=_frames)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    ctx: Ctx,
    caller: CallerDep,
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> JSONResponse:
    items = await ctx.responses.input_items(response_id, caller.owner)
    return JSONResponse(
        ResponseItemList.page(items if order == "asc" else items[::-1], limit, after).model_dump()
    )


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(await background.cancel(ctx, caller, response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    await ctx.responses.delete(response_id, caller.owner)
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


async def _frames(job: Job, events: AsyncIterator[ResponseStreamEvent]) -> AsyncIterator[bytes]:
    """Named SSE events, numbered by their `sequence_number`; an error after the headers went out
    travels as an `error` event."""
    try:
        async for event in events:
            if event.sequence_number > job.after:
                yield sse.event(event.type, event, event.sequence_number)
    except CortexError as exc:
        log.info(
            "job=%s request=%s failed while streaming: %s", job.id, job.request_id, exc.message
        )
        yield sse.event(
            "error", ResponseErrorEvent(code=exc.code, message=exc.message, param=exc.param)
        )
