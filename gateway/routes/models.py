"""`GET /v1/models`: the catalogue's models and those live nodes serve, with their state; only
those the caller's key may use."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.auth import CallerDep
from gateway.context import Ctx
from gateway.render.models import model_list

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(model_list(ctx.catalog, await ctx.fleet.serving_nodes(), caller.may_use).model_dump())
