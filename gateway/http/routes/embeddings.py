"""`POST /v1/embeddings` (OpenAI)."""

from fastapi import APIRouter, Request

from gateway.dialects.protocol.embeddings import EmbeddingCreateParams
from gateway.dialects.render.embeddings import embedding_response
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.http.vector_json import VectorJSONResponse
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.pooling import embed

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(
    body: EmbeddingCreateParams, ctx: Ctx, request: Request, caller: CallerDep
) -> VectorJSONResponse:
    result = await unless_disconnected(
        request, embed(ctx, caller, body.model, body.inputs, dimensions=body.dimensions)
    )
    return VectorJSONResponse(embedding_response(body.model, result, body.encoding_format))
