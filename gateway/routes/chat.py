"""`POST /v1/chat/completions`, and `GET /v1/chat/completions/{id}?stream=true` to resume a stream."""

from fastapi import APIRouter, Request, Response

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.jobs import Job, Resumable, submit_request
from gateway.protocol.openai import ChatCompletionRequest
from gateway.render.chat import chat_chunks, chat_completion
from gateway.resume import ResumeAt, on_disconnect, resume
from gateway.streaming import stream_job, whole_or_streamed

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    spec = {"n": body.n, "include_usage": body.include_usage}
    resumable = Resumable("chat", spec, on_disconnect(request)) if body.stream else None
    job = await submit_request(ctx, body, caller, resumable=resumable)
    return await whole_or_streamed(request, job, body.stream, lambda: _chunks(job, spec),
                                   lambda gathered: chat_completion(job, gathered, job.parsers), body.n)


@router.get("/v1/chat/completions/{completion_id}", response_model=None)
async def resume_chat_completion(completion_id: str, ctx: Ctx, request: Request, caller: CallerDep,
                                 at: ResumeAt) -> Response:
    job = await resume(ctx, caller, "chat", completion_id, "chatcmpl-", at)
    return await stream_job(request, job, _chunks(job, job.record.spec))


def _chunks(job: Job, spec: dict):
    return chat_chunks(job, job.events(), n=spec["n"], include_usage=spec["include_usage"], parsers=job.parsers)
