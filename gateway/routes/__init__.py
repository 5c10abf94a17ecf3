"""HTTP routes: each maps a request to a job and the job's events to JSON or SSE, nothing more."""

from fastapi import APIRouter, Depends

from gateway.auth import authenticate
from gateway.routes import (admin, batches, chat, completions, dashboard, embeddings, files, health, keys, message_batches,
                            messages, models, queue, rerank, responses)

router = APIRouter()
# an API key's routes
for module in (chat, completions, embeddings, rerank, message_batches, messages, responses, models, files, batches, queue):
    router.include_router(module.router, dependencies=[Depends(authenticate)])
for module in (health, admin, keys, dashboard):
    router.include_router(module.router)
