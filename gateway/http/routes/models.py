"""`GET /v1/models` and `GET /v1/models/{id}`: the catalogue's models, aliases and LoRA adapters,
and the live nodes' state of each; only those the caller's key may use. vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (admin key; gateway/fleet/adapters.py)."""

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gateway.dialects.render.models import model_card, model_list
from gateway.fleet import adapters
from gateway.http.auth import CallerDep, require_admin
from gateway.http.context import Ctx

router = APIRouter()


class LoadLoraAdapter(BaseModel):
    """vLLM's body; `base_model_name` (ours) where the adapter's files name no catalogue model."""

    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (load_inplace)
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


@router.post("/v1/load_lora_adapter", dependencies=[Depends(require_admin)])
async def load_lora_adapter(body: LoadLoraAdapter, ctx: Ctx) -> PlainTextResponse:
    adapters.load(ctx.catalog, body.lora_name, body.lora_path, body.base_model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(require_admin)])
async def unload_lora_adapter(body: UnloadLoraAdapter, ctx: Ctx) -> PlainTextResponse:
    adapters.unload(ctx.catalog, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.get("/v1/models")
async def list_models(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(
        model_list(
            ctx.catalog, await ctx.fleet.serving_nodes(fresh=True), caller.may_use
        ).model_dump()
    )


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(
        model_card(
            ctx.catalog, await ctx.fleet.serving_nodes(fresh=True), model_id, caller.may_use
        ).model_dump()
    )
