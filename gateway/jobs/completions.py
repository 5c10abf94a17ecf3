"""What the OpenAI chat completions and legacy completions routes share: a request submitted
(resumable when streamed), then streamed as chunks or its `n` choices gathered into one JSON body;
and a stream resumed from its event log. The two differ only in their `CompletionDialect`: the
renderers, and what they need besides the job's events (`spec`, kept in the job's record so that a
resumed stream is rendered as the first one was)."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.dialects.gather import Gathered, gather_choices
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.job import Job, Resumable
from gateway.jobs.resume import ResumePoint, on_disconnect, resume
from gateway.jobs.streaming import stream_job
from gateway.jobs.submit import submit_request


@dataclass(frozen=True)
class CompletionDialect:
    name: str  # the job record's dialect (`Resumable.dialect`)
    id_prefix: str  # of the API object's id
    spec: Callable[[Any], dict]  # the request → what the renderers need
    chunks: Callable[[Job, dict], AsyncIterator[BaseModel]]  # the job's events, streamed
    whole: Callable[[Job, Gathered, dict], BaseModel]  # its choices, gathered

    async def answer(
        self, request: Request, ctx: JobContext, caller: Caller, body: Any
    ) -> Response:
        spec = self.spec(body)
        resumable = Resumable(self.name, spec, on_disconnect(request)) if body.stream else None
        job = await submit_request(ctx, body, caller, resumable=resumable)
        if body.stream:
            return await stream_job(request, job, self.chunks(job, spec))
        async with job:
            gathered = await unless_disconnected(
                request, gather_choices(job.final_events(), body.n)
            )
        return JSONResponse(self.whole(job, gathered, spec).model_dump(mode="json"))

    async def resumed(
        self, request: Request, ctx: JobContext, caller: Caller, given_id: str, at: ResumePoint
    ) -> Response:
        job = await resume(ctx, caller, self.name, given_id, self.id_prefix, at)
        return await stream_job(request, job, self.chunks(job, job.record.spec))
