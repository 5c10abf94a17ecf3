"""HTTP routes: each maps a request to a job and the job's events to JSON or SSE, nothing more."""

from fastapi import APIRouter, Depends

from gateway.http.auth import authenticate
from gateway.http.routes import (
    admin,
    batches,
    chat,
    completions,
    dashboard,
    embeddings,
    files,
    health,
    keys,
    message_batches,
    messages,
    models,
    ollama,
    queue,
    rerank,
    responses,
)

router = APIRouter()
api_key_routes = (
    chat,
    completions,
    embeddings,
    rerank,
    message_batches,
    messages,
    responses,
    models,
    files,
    batches,
    queue,
    ollama,
)
for module in api_key_routes:
    router.include_router(module.router, dependencies=[Depends(authenticate)])
for module in (health, admin, keys, dashboard):
    router.include_router(module.router)
router.include_router(ollama.public)
router.include_router(ollama.admin)
