"""`POST /v1/embeddings` (OpenAI)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.dialects.protocol.embeddings import EmbeddingCreateParams
from gateway.dialects.render.embeddings import embedding_response
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.pooling import embed

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(
    body: EmbeddingCreateParams, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    result = await unless_disconnected(
        request, embed(ctx, caller, body.model, body.inputs, dimensions=body.dimensions)
    )
    return JSONResponse(
        embedding_response(body.model, result, body.encoding_format).model_dump(mode="json")
    )
