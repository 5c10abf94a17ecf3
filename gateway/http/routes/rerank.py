"""`POST /v1/rerank` and `/rerank` (the Cohere and Jina shape) and `POST /v1/score` (vLLM's), on
rerank models (cross-encoders)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.dialects.protocol.rerank import RerankRequest, ScoreRequest
from gateway.dialects.render.embeddings import rerank_response, score_response
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.pooling import score

router = APIRouter()


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(
    body: RerankRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    documents = body.texts
    result = await unless_disconnected(
        request, score(ctx, caller, body.model, [body.query] * len(documents), documents)
    )
    response = rerank_response(body.model, documents, result, body.top_n, body.return_documents)
    return JSONResponse(response.model_dump(mode="json", exclude_none=True))


@router.post("/v1/score")
async def create_score(
    body: ScoreRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    result = await unless_disconnected(request, score(ctx, caller, body.model, *body.pairs()))
    return JSONResponse(score_response(body.model, result).model_dump(mode="json"))
