"""`POST /v1/completions`, and `GET /v1/completions/{id}?stream=true` to resume a stream."""

from fastapi import APIRouter, Request, Response

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.jobs import Job, Resumable, submit_request
from gateway.protocol.openai import CompletionRequest
from gateway.render.completions import completion, completion_chunks
from gateway.resume import ResumeAt, on_disconnect, resume
from gateway.streaming import stream_job, whole_or_streamed

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    spec = {"n": body.n, "include_usage": body.include_usage, "echo": body.echo}
    resumable = Resumable("completions", spec, on_disconnect(request)) if body.stream else None
    job = await submit_request(ctx, body, caller, resumable=resumable)
    return await whole_or_streamed(request, job, body.stream, lambda: _chunks(job, spec),
                                   lambda gathered: completion(job, gathered, body.echo), body.n)


@router.get("/v1/completions/{completion_id}", response_model=None)
async def resume_completion(completion_id: str, ctx: Ctx, request: Request, caller: CallerDep,
                            at: ResumeAt) -> Response:
    job = await resume(ctx, caller, "completions", completion_id, "cmpl-", at)
    return await stream_job(request, job, _chunks(job, job.record.spec))


def _chunks(job: Job, spec: dict):
    return completion_chunks(job, job.events(), n=spec["n"], include_usage=spec["include_usage"], echo=spec["echo"])
