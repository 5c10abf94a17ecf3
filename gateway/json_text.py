"""JSON bodies whose strings are not text: `"\\ud800"` is valid JSON (an escaped UTF-16 half) but an
unpaired surrogate is no Unicode character, and nothing downstream can encode it (UTF-8 for Redis,
msgpack for the nodes, a tokenizer). Such a body is refused as invalid JSON (400 in the dialect's
shape, `gateway/errors.py`) before any route reads it; a surrogate pair (`"\\ud83d\\ude00"`, how
ASCII-only encoders send an emoji) is one character and passes."""

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where one may hide; most bodies have none
UNPAIRED = "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff alone), which is not Unicode text"


def has_unpaired_surrogate(body: bytes) -> bool:
    """Whether a JSON body decodes to a string holding a lone surrogate (False when it is not JSON at
    all: the route's parser says so)."""
    if not SURROGATE_ESCAPE.search(body):
        return False
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _is_json(scope: Scope) -> bool:
    """A body FastAPI parses as JSON: one that says so, or says nothing."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return not content_type or content_type.endswith(b"/json") or content_type.endswith(b"+json")


class JsonTextMiddleware:
    """Reads the body along with the route; its last chunk raises `JSONDecodeError` when the whole is
    not text, which FastAPI answers as a malformed body (`json_invalid`)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def checked() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body") and has_unpaired_surrogate(body := b"".join(chunks)):
                    raise json.JSONDecodeError(UNPAIRED, body.decode("utf-8", "replace"), 0)
            return message

        await self.app(scope, checked, send)
