"""`/admin/keys`: API keys, behind the admin key; the twins of `cortex keys create | list | show |
revoke`. The secret is in the answer to `POST /admin/keys` and nowhere else, ever."""

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.http.auth import require_admin
from gateway.http.context import Ctx
from shared.api_keys import KeySpec

router = APIRouter(prefix="/admin/keys", dependencies=[Depends(require_admin)])


@router.post("")
async def create_key(spec: KeySpec, ctx: Ctx) -> JSONResponse:
    key, secret = await ctx.api_keys.create(spec)
    return JSONResponse(key.shown() | {"secret": secret})


@router.get("")
async def list_keys(ctx: Ctx) -> JSONResponse:
    return JSONResponse(
        {"object": "list", "data": [key.shown() for key in await ctx.api_keys.list()]}
    )


@router.get("/{name}")
async def show_key(name: str, ctx: Ctx) -> JSONResponse:
    return JSONResponse((await ctx.api_keys.get(name)).shown())


@router.post("/{name}/revoke")
async def revoke_key(name: str, ctx: Ctx) -> JSONResponse:
    return JSONResponse((await ctx.api_keys.revoke(name)).shown())
