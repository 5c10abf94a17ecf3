"""A job streamed as server-sent events. The response owns the job: whatever ends the stream
(the done event, an error, or the body never being sent at all), the job is closed, which
cancels it on the node if it had not finished; when the client goes away (or this gateway stops),
the job is detached instead, and runs on as its `on_disconnect` says (gateway/jobs/job.py).

Every frame of a job's stream is numbered (its SSE `id:`), counting the dialect's objects from 0;
a resumed stream (gateway/jobs/resume.py) renders the job's events again and sends only the frames
after the one the client saw last (`Job.after`)."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dialects.errors import error_body
from gateway.jobs import sse
from gateway.jobs.disconnect import ClientDisconnected, unless_disconnected
from gateway.jobs.job import Job
from shared.errors import CortexError

log = logging.getLogger(__name__)

T = TypeVar("T")

Frames = Callable[[Job, AsyncIterator[BaseModel]], AsyncIterator[bytes]]


async def stream_job(
    request: Request,
    job: Job,
    chunks: AsyncIterator[BaseModel],
    frames: Frames | None = None,
    headers: dict[str, str] | None = None,
    *,
    media_type: str = sse.MEDIA_TYPE,
    queue_notice: Callable[[int], bytes] | None = sse.queued,
) -> StreamingResponse:
    """Wait for the job's first event (errors before it are plain HTTP errors), then stream
    `chunks` (rendered from `job.events()`) as SSE frames: by default OpenAI's, ending with
    `data: [DONE]`; `frames` frames them another way (Anthropic's named events, Ollama's NDJSON
    lines, with their `media_type`). A job still queued starts the response at once, with a
    `queue_notice` of its place as it changes (None: nothing until its first token). `headers` go
    out with the response."""
    make = frames or _frames
    first = asyncio.ensure_future(job.first_event())
    try:
        place = await unless_disconnected(request, job.first_event_or_position(first))
    except BaseException as exc:
        first.cancel()
        await (job.detach() if isinstance(exc, ClientDisconnected) else job.close())
        raise
    body = make(job, chunks)
    if (
        place > 0
    ):  # waiting in the queue: start the response now, with `: queued position=N` comments
        body = queued_frames(
            job, first, place, body, lambda exc: make(job, _raise(exc)), queue_notice
        )
    return JobStreamResponse(
        job, body, {QUEUE_POSITION_HEADER: str(place)} | (headers or {}), media_type
    )


QUEUE_POSITION_HEADER = "x-cortex-queue-position"


async def queued_frames(
    job: Job,
    first: asyncio.Future,
    place: int,
    frames: AsyncIterator[bytes],
    failed: Callable[[CortexError], AsyncIterator[bytes]],
    notice: Callable[[int], bytes] | None = sse.queued,
) -> AsyncIterator[bytes]:
    """A `notice` of the job's place (SSE comments `: queued position=N`; None: nothing, for a
    framing that has no comments) while the job waits, then the job's own frames (or, if it failed
    before its first token, the dialect's error frames)."""
    try:
        async for place in job.places(first, place):
            if notice is not None:
                yield notice(place)
        try:
            first.result()
        except CortexError as exc:
            async for frame in failed(exc):
                yield frame
            return
        async for frame in frames:
            yield frame
    finally:
        if not first.done():
            first.cancel()


async def _raise(exc: CortexError) -> AsyncIterator[BaseModel]:
    raise exc
    yield  # an async generator that fails at once


async def numbered(job: Job, chunks: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Each chunk with its number (from 0), leaving out those the client has seen (up to `job.after`)."""
    number = -1
    async for chunk in chunks:
        number += 1
        if number > job.after:
            yield number, chunk


def failed_while_streaming(job: Job, exc: CortexError) -> None:
    """Log a job that failed after its response's headers went out (its error travels in the stream)."""
    log.info(
        "job=%s request=%s key=%s failed while streaming: %s",
        job.id,
        job.request_id,
        job.caller.name,
        exc.message,
    )


async def _frames(job: Job, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    try:
        async for number, chunk in numbered(job, chunks):
            yield sse.data(chunk, number)
    except CortexError as exc:  # after the headers went out, an error travels in the stream
        failed_while_streaming(job, exc)
        yield sse.data(error_body(exc))
    yield sse.DONE


class JobStreamResponse(StreamingResponse):
    def __init__(
        self,
        job: Job,
        frames: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        media_type: str = sse.MEDIA_TYPE,
    ):
        super().__init__(frames, media_type=media_type, headers=sse.HEADERS | (headers or {}))
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream until the body ends or the client disconnects, whichever ASGI version the
        server speaks; then close the job, or detach it if the client went away first."""
        ended = False
        try:
            async with anyio.create_task_group() as task_group:

                async def stream() -> None:
                    nonlocal ended
                    try:
                        await self.stream_response(send)
                        ended = True
                    except OSError:  # ASGI 2.4 servers raise on send once the client is gone
                        pass
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:  # not ended: the client went away, or the server is stopping (cancelled)
            await (self.job.close() if ended else self.job.detach())
