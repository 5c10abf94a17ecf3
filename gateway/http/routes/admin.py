"""`/admin/*`: fleet operations behind the admin key (`Authorization: Bearer <CORTEX_ADMIN_KEY>`),
and `/metrics` for Prometheus (every series for the admin key, or anyone while auth is off; else
the anonymous view, gateway/http/metrics_view.py)."""

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.fleet import operations
from gateway.http.auth import metrics_access, require_admin
from gateway.http.context import Ctx
from gateway.http.metrics_view import AnonymousView

router = APIRouter()
admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/metrics")
async def metrics(ctx: Ctx, sees_all: Annotated[bool, Depends(metrics_access)]) -> Response:
    seen = ctx.metrics.registry if sees_all else AnonymousView(ctx.metrics)
    return Response(generate_latest(seen), media_type=CONTENT_TYPE_LATEST)


@admin.post("/models/{model}/load")
async def load(model: str, ctx: Ctx, node: str | None = None) -> JSONResponse:
    return JSONResponse({"model": model, "node": await operations.load(ctx.placer, model, node)})


@admin.post("/models/{model}/unload")
async def unload(model: str, ctx: Ctx, node: str | None = None) -> JSONResponse:
    return JSONResponse({"model": model, "nodes": await operations.unload(ctx.placer, model, node)})


@admin.post("/models/{model}/pull")
async def pull(model: str, ctx: Ctx) -> JSONResponse:
    return JSONResponse({"model": model, "nodes": await operations.pull(ctx.placer, model)})


@admin.delete("/models/{model}/files")
async def remove_files(model: str, ctx: Ctx, node: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"model": model, "nodes": await operations.remove_files(ctx.placer, model, node)}
    )


@admin.post("/models/{model}/pin")
async def pin(model: str, ctx: Ctx) -> JSONResponse:
    await operations.set_pin(ctx.placer, model, True)
    return JSONResponse({"model": model, "pinned": True})


@admin.post("/models/{model}/unpin")
async def unpin(model: str, ctx: Ctx) -> JSONResponse:
    await operations.set_pin(ctx.placer, model, False)
    return JSONResponse({"model": model, "pinned": False})


@admin.post("/nodes/{node}/drain")
async def drain(node: str, ctx: Ctx) -> JSONResponse:
    await operations.drain(ctx.placer, node)
    return JSONResponse({"node": node, "draining": True})


router.include_router(admin)
