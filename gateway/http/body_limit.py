"""A limit on request bodies (`max_request_bytes`; uploads to `/v1/files` have `files_max_bytes`):
a body over it is refused with 413 in the dialect's shape before it is read, when it says its
length, or as soon as it grows past the limit, when it is chunked (`gateway/http/errors.py` answers that one)."""

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import error_response
from shared.errors import RequestTooLarge

FILES_PATH = "/v1/files"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, files_max_bytes: int):
        self.app, self.max_bytes, self.files_max_bytes = app, max_bytes, files_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = (
            self.files_max_bytes + 64 * 1024
            if scope["path"].startswith(FILES_PATH)
            else self.max_bytes
        )
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await error_response(_too_large(limit), Request(scope))(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI turns any other error while reading the body into a 400
                raise HTTPException(413, _too_large(limit).message)
            return message

        await self.app(scope, counted, send)


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body is over the limit of {limit} bytes (max_request_bytes)"
    )
