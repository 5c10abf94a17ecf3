"""`/dashboard`: the fleet at a glance in a browser. The page (gateway/static/dashboard.html, no
build step) is static and holds no data; it polls `/dashboard/data`, which needs the admin key
whenever auth is on (gateway/auth.require_dashboard). The page takes the key from its URL's
fragment (`/dashboard#key=...`, never sent to a server or logged) or asks for it."""

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.http.auth import require_dashboard
from gateway.http.context import Ctx

router = APIRouter()
PAGE = (Path(__file__).resolve().parents[2] / "static" / "dashboard.html").read_text()


@router.get("/dashboard", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})


@router.get("/dashboard/data", dependencies=[Depends(require_dashboard)])
async def data(ctx: Ctx) -> JSONResponse:
    return JSONResponse(await ctx.dashboard.data(ctx), headers={"Cache-Control": "no-store"})
