"""Server-sent events framing: `data: {json}\\n\\n` frames ending with `data: [DONE]\\n\\n`."""

import json
from typing import Any

from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer
DONE = b"data: [DONE]\n\n"


def data(payload: BaseModel | dict[str, Any]) -> bytes:
    """One SSE frame carrying `payload` as JSON."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


def event(name: str, payload: BaseModel | dict[str, Any]) -> bytes:
    """One named SSE frame, as Anthropic streams: `event: {name}\ndata: {json}\n\n`."""
    return b"event: " + name.encode() + b"\n" + data(payload)
