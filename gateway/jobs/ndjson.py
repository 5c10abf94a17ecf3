"""Newline-delimited JSON framing, as Ollama streams: one JSON object a line, no comments and no
end marker (the last object says `done: true`). An error after the headers went out is a line of
its own, `{"error": "..."}`, which Ollama's clients raise."""

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from gateway.dialects.errors import ollama_error_body
from gateway.jobs.job import Job
from gateway.jobs.streaming import failed_while_streaming
from shared.errors import CortexError

MEDIA_TYPE = "application/x-ndjson"


def line(payload: BaseModel | dict[str, Any]) -> bytes:
    """One object as a line; a model leaves out its fields that are not set (None), as Ollama does."""
    if isinstance(payload, BaseModel):
        return payload.model_dump_json(exclude_none=True).encode() + b"\n"
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


async def frames(job: Job, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield line(chunk)
    except CortexError as exc:
        failed_while_streaming(job, exc)
        yield line(ollama_error_body(exc))
