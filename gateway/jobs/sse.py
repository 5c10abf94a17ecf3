"""Server-sent events framing: `data: {json}\\n\\n` frames ending with `data: [DONE]\\n\\n`. A frame
of a job's stream carries its number as its `id:` (the SSE standard's event id): a client that lost
the connection resumes after the last number it saw (`Last-Event-ID` or `starting_after`)."""

import json
from typing import Any

from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer
DONE = b"data: [DONE]\n\n"


def data(payload: BaseModel | dict[str, Any], id: int | None = None) -> bytes:
    """One SSE frame carrying `payload` as JSON (numbered `id` if given)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return (b"" if id is None else b"id: %d\n" % id) + b"data: " + body.encode() + b"\n\n"


def event(name: str, payload: BaseModel | dict[str, Any], id: int | None = None) -> bytes:
    """One named SSE frame, as Anthropic streams: `event: {name}\ndata: {json}\n\n`."""
    return b"event: " + name.encode() + b"\n" + data(payload, id)


def queued(place: int) -> bytes:
    """The comment a stream carries while its job waits in the queue (clients ignore comments)."""
    return f": queued position={place}\n\n".encode()
