"""`POST /v1/chat/completions`, and `GET /v1/chat/completions/{id}?stream=true` to resume a stream."""

from fastapi import APIRouter, Request, Response

from gateway.dialects.protocol.openai import ChatCompletionRequest
from gateway.dialects.render.chat import chat_chunks, chat_completion
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs.completions import CompletionDialect
from gateway.jobs.resume import ResumeAt

router = APIRouter()

CHAT = CompletionDialect(
    "chat",
    "chatcmpl-",
    spec=lambda body: {"n": body.n, "include_usage": body.include_usage},
    chunks=lambda job, spec: chat_chunks(
        job, job.events(), n=spec["n"], include_usage=spec["include_usage"], parsers=job.parsers
    ),
    whole=lambda job, gathered, spec: chat_completion(job, gathered, job.parsers),
)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> Response:
    return await CHAT.answer(request, ctx, caller, body)


@router.get("/v1/chat/completions/{completion_id}", response_model=None)
async def resume_chat_completion(
    completion_id: str, ctx: Ctx, request: Request, caller: CallerDep, at: ResumeAt
) -> Response:
    return await CHAT.resumed(request, ctx, caller, completion_id, at)
