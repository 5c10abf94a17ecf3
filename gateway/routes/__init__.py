"""HTTP routes: each maps a request to a job and the job's events to JSON or SSE, nothing more."""

from fastapi import APIRouter

from gateway.routes import admin, batches, chat, completions, files, health, messages, models, queue, responses

router = APIRouter()
for module in (chat, completions, messages, responses, models, health, files, batches, queue, admin):
    router.include_router(module.router)
