"""`GET /v1/models`: models ready or loading on live nodes."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.context import Ctx
from gateway.render.models import model_list

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> JSONResponse:
    return JSONResponse(model_list(ctx.catalog, await ctx.fleet.serving_nodes()).model_dump())
