"""HTTP routes: each maps a request to a job and the job's events to JSON or SSE, nothing more."""

from fastapi import APIRouter

from gateway.routes import chat, completions, health, messages, models

router = APIRouter()
for module in (chat, completions, messages, models, health):
    router.include_router(module.router)
