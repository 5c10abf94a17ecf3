"""OpenAI Responses API: `POST /v1/responses` (stream and not), `GET` and `DELETE
/v1/responses/{id}`. A response is stored (`store`, default true) so that a later request can
continue from it with `previous_response_id`."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from gateway import sse
from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.disconnect import unless_disconnected
from gateway.gather import gather
from gateway.jobs import Job, submit_request
from gateway.protocol.responses import ResponseCreateParams, ResponseDeleted, ResponseErrorEvent, ResponseStreamEvent
from gateway.render.responses import response, response_events
from gateway.responses_store import ResponseStore
from gateway.streaming import log, stream_job
from shared.errors import CortexError

router = APIRouter()


def _store(ctx: Ctx) -> ResponseStore:
    return ResponseStore(ctx.redis, ctx.keys, ctx.settings.responses_ttl_s)


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponseCreateParams, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    store = _store(ctx)
    if body.previous_response_id:
        body.continue_from(await store.conversation(body.previous_response_id))
    job = await submit_request(ctx, body, caller)
    parser, headers = job.parsers(), _warning(job, body)
    if body.stream:
        events = response_events(job, body, job.events(), parser)
        if body.store is not False:
            events = store.kept_at_the_end(events, body.conversation)
        return await stream_job(request, job, events, frames=_frames, headers=headers)
    async with job:
        gathered = await unless_disconnected(request, gather(job.events(), 1))
    answer = response(job, body, gathered.choices[0], gathered.usage, parser)
    if body.store is not False:
        await store.put(answer, body.conversation)
    return JSONResponse(answer.model_dump(mode="json"), headers=headers)


def _warning(job: Job, body: ResponseCreateParams) -> dict[str, str]:
    """A `Warning` header (and a log line) naming the tools the model was not offered."""
    warning = body.offer.warning
    if warning is None:
        return {}
    log.info("job=%s request=%s %s", job.id, job.request_id, warning)
    return {"Warning": f'299 cortex "{warning}"'}  # tool types and names only: no quotes, nothing beyond ASCII


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, ctx: Ctx) -> JSONResponse:
    return JSONResponse(await _store(ctx).get(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Ctx) -> JSONResponse:
    await _store(ctx).delete(response_id)
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


async def _frames(job: Job, events: AsyncIterator[ResponseStreamEvent]) -> AsyncIterator[bytes]:
    """Named SSE events; an error after the headers went out travels as an `error` event."""
    try:
        async for event in events:
            yield sse.event(event.type, event)
    except CortexError as exc:
        log.info("job=%s request=%s failed while streaming: %s", job.id, job.request_id, exc.message)
        yield sse.event("error", ResponseErrorEvent(code=exc.code, message=exc.message, param=exc.param))
