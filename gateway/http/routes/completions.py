"""`POST /v1/completions`, and `GET /v1/completions/{id}?stream=true` to resume a stream."""

from fastapi import APIRouter, Request, Response

from gateway.dialects.protocol.openai import CompletionRequest
from gateway.dialects.render.completions import completion, completion_chunks
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs.completions import CompletionDialect
from gateway.jobs.resume import ResumeAt

router = APIRouter()

COMPLETIONS = CompletionDialect(
    "completions",
    "cmpl-",
    spec=lambda body: {"n": body.n, "include_usage": body.include_usage, "echo": body.echo},
    chunks=lambda job, spec: completion_chunks(
        job, job.events(), n=spec["n"], include_usage=spec["include_usage"], echo=spec["echo"]
    ),
    whole=lambda job, gathered, spec: completion(job, gathered, spec["echo"]),
)


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> Response:
    return await COMPLETIONS.answer(request, ctx, caller, body)


@router.get("/v1/completions/{completion_id}", response_model=None)
async def resume_completion(
    completion_id: str, ctx: Ctx, request: Request, caller: CallerDep, at: ResumeAt
) -> Response:
    return await COMPLETIONS.resumed(request, ctx, caller, completion_id, at)
