"""`GET /v1/models` and `GET /v1/models/{id}`: the catalogue's models and aliases, and the live
nodes' state of each; only those the caller's key may use."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.dialects.render.models import model_card, model_list
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(
        model_list(ctx.catalog, await ctx.fleet.serving_nodes(), caller.may_use).model_dump()
    )


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(
        model_card(
            ctx.catalog, await ctx.fleet.serving_nodes(), model_id, caller.may_use
        ).model_dump()
    )
