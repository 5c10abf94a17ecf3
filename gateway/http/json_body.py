"""JSON bodies that are valid JSON but no request's data, refused as invalid JSON (400 in the
dialect's shape, `gateway/http/errors.py`) before any route reads them:

- strings that are not text: `"\\ud800"` is an escaped UTF-16 half, and an unpaired surrogate is no
  Unicode character, which nothing downstream can encode (UTF-8 for Redis, msgpack for the nodes, a
  tokenizer); a pair (`"\\ud83d\\ude00"`, how ASCII-only encoders send an emoji) is one character and
  passes;
- nesting deeper than `MAX_DEPTH`: free-form fields (tool schemas, `chat_template_kwargs`,
  `metadata`) are walked recursively by pydantic's serializer (~250 levels), by transformers when it
  renders a chat template (~500), by msgpack (512); no real request comes near."""

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_DEPTH = (
    64  # arrays and objects within one another; OpenAI's structured outputs allow 10 schema levels
)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where one may hide; most bodies have none
STRING = re.compile(
    rb'"[^"\\]*(?:\\.[^"\\]*)*"'
)  # unrolled: ~60 ms for an 8 MB body of short strings
INNERMOST = re.compile(
    rb"\[\]|\{\}"
)  # a pair with nothing (but values) inside, once strings are gone
NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
UNPAIRED = "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff alone), which is not Unicode text"
TOO_DEEP = f"arrays and objects are nested more than {MAX_DEPTH} deep"


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


def too_deep(body: bytes) -> bool:
    """Whether a JSON body nests arrays and objects more than `MAX_DEPTH` deep (brackets in strings
    do not count)."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return False
    brackets = STRING.sub(b"", body).translate(None, NOT_BRACKETS)
    for _ in range(MAX_DEPTH):  # each round takes away one level
        inner = INNERMOST.sub(b"", brackets)
        if not inner or inner == brackets:  # all gone; or unbalanced, which the parser refuses
            return False
        brackets = inner
    return True


def _is_json(scope: Scope) -> bool:
    """A body FastAPI parses as JSON: one that says so, or says nothing."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return not content_type or content_type.endswith(b"/json") or content_type.endswith(b"+json")


class JsonBodyMiddleware:
    """Reads the body along with the route; its last chunk raises `JSONDecodeError` when the whole is
    no request's data, which FastAPI answers as a malformed body (`json_invalid`)."""

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
                if not message.get("more_body"):
                    body = b"".join(chunks)
                    for refused, why in ((has_unpaired_surrogate, UNPAIRED), (too_deep, TOO_DEEP)):
                        if refused(body):
                            raise json.JSONDecodeError(why, body.decode("utf-8", "replace"), 0)
            return message

        await self.app(scope, checked, send)
