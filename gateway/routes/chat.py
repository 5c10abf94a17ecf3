"""`POST /v1/chat/completions`."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.disconnect import unless_disconnected
from gateway.gather import gather
from gateway.jobs import submit_request
from gateway.protocol.openai import ChatCompletionRequest
from gateway.render.chat import chat_chunks, chat_completion
from gateway.streaming import stream_job

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    job = await submit_request(ctx, body, caller)
    if body.stream:
        chunks = chat_chunks(job, job.events(), n=body.n, include_usage=body.include_usage, parsers=job.parsers)
        return await stream_job(request, job, chunks)
    async with job:
        gathered = await unless_disconnected(request, gather(job.events(), body.n))
    return JSONResponse(chat_completion(job, gathered, job.parsers).model_dump(mode="json"))
