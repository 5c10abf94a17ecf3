"""`POST /v1/embeddings` (OpenAI)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.disconnect import unless_disconnected
from gateway.pooling import embed
from gateway.protocol.embeddings import EmbeddingCreateParams
from gateway.render.embeddings import embedding_response

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
