"""`POST /v1/completions`."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.disconnect import unless_disconnected
from gateway.gather import gather
from gateway.jobs import submit_request
from gateway.protocol.openai import CompletionRequest
from gateway.render.completions import completion, completion_chunks
from gateway.streaming import stream_job

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    job = await submit_request(ctx, body, caller)
    if body.stream:
        chunks = completion_chunks(job, job.events(), n=body.n, include_usage=body.include_usage, echo=body.echo)
        return await stream_job(request, job, chunks)
    async with job:
        gathered = await unless_disconnected(request, gather(job.events(), body.n))
    return JSONResponse(completion(job, gathered, body.echo).model_dump(mode="json"))
