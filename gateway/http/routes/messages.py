"""Anthropic `POST /v1/messages` and `POST /v1/messages/count_tokens`, and `GET
/v1/messages/{id}?stream=true` to resume a stream.

The key comes as `x-api-key` (or `Authorization: Bearer`); `anthropic-version` is accepted. Token counts
come from a `count` job: the node that serves the model renders the prompt with the model's
own tokenizer and template (the code that renders real prompts) and answers with its length,
so the gateway needs neither transformers nor the model's files.
"""

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway.dialects.errors import anthropic_error_body
from gateway.dialects.gather import gather_choices
from gateway.dialects.protocol.anthropic import (
    MessageCountTokensParams,
    MessageCreateParams,
    MessageTokensCount,
    PingEvent,
)
from gateway.dialects.render.messages import message, message_events
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs import sse
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.job import Job, Resumable
from gateway.jobs.resume import ResumeAt, on_disconnect, resume
from gateway.jobs.streaming import failed_while_streaming, numbered, stream_job
from gateway.jobs.submit import submit_request
from shared.errors import CortexError

router = APIRouter()

PING_INTERVAL_S = (
    10.0  # a `ping` event after this long without one, so proxies keep the stream open
)


@router.post("/v1/messages", response_model=None)
async def create_message(
    body: MessageCreateParams,
    ctx: Ctx,
    request: Request,
    caller: CallerDep,
    x_api_key: str | None = Header(None),
    anthropic_version: str | None = Header(None),
) -> Response:
    job = await submit_request(
        ctx,
        body,
        caller,
        resumable=Resumable("messages", {}, on_disconnect(request)) if body.stream else None,
    )
    parser = job.parsers()
    if body.stream:
        return await stream_job(
            request, job, message_events(job, job.events(), parser), frames=_frames
        )
    async with job:
        gathered = await unless_disconnected(request, gather_choices(job.final_events(), 1))
    return JSONResponse(
        message(job, gathered.choices[0], gathered.usage, parser).model_dump(mode="json")
    )


@router.get("/v1/messages/{message_id}", response_model=None)
async def resume_message(
    message_id: str,
    ctx: Ctx,
    request: Request,
    caller: CallerDep,
    at: ResumeAt,
    x_api_key: str | None = Header(None),
    anthropic_version: str | None = Header(None),
) -> Response:
    job = await resume(ctx, caller, "messages", message_id, "msg_", at)
    return await stream_job(
        request, job, message_events(job, job.events(), job.parsers()), frames=_frames
    )


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(
    body: MessageCountTokensParams,
    ctx: Ctx,
    request: Request,
    caller: CallerDep,
    x_api_key: str | None = Header(None),
    anthropic_version: str | None = Header(None),
) -> Response:
    job = await submit_request(ctx, body, caller)
    async with job:
        gathered = await unless_disconnected(request, gather_choices(job.final_events(), 1))
    return JSONResponse(MessageTokensCount(input_tokens=gathered.usage.prompt_tokens).model_dump())


async def _frames(job: Job, events: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    """Named SSE events, numbered; a `ping` (not numbered) after message_start and whenever the
    model is quiet for PING_INTERVAL_S; an error after the headers went out travels as an `error` event."""
    pending: asyncio.Future | None = None
    events = numbered(job, events)
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=PING_INTERVAL_S)
            if not done:
                yield sse.event("ping", PingEvent())
                continue
            (number, item), pending = pending.result(), None
            yield sse.event(item.type, item, number)
            if item.type == "message_start":
                yield sse.event("ping", PingEvent())
    except StopAsyncIteration:
        return
    except CortexError as exc:
        failed_while_streaming(job, exc)
        yield sse.event("error", anthropic_error_body(exc))
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
