"""Every error the gateway returns, mapped in one place: typed `CortexError`s carry their own
status; request validation → 400 naming the field; malformed JSON → 400; unknown routes → 404;
Redis down or refusing writes → 503 naming the cause. Routes under `/v1/messages` answer in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}`; Ollama's under `/api/` in its shape `{"error": "..."}`;
all others in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`."""

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from gateway.dialects.errors import (
    anthropic_error_body,
    anthropic_status,
    error_body,
    ollama_error_body,
)
from gateway.dialects.protocol.openai import Error, ErrorResponse
from gateway.jobs.caller import caller_var
from gateway.tracing import request_id_var
from shared.errors import CortexError, InvalidRequest, RequestTooLarge
from shared.redis_conn import broker_error

log = logging.getLogger(__name__)

MAX_LISTED = 3  # validation problems named in one message


ANTHROPIC_PATHS = "/v1/messages"


def is_anthropic(request: Request | None) -> bool:
    return request is not None and request.url.path.startswith(ANTHROPIC_PATHS)


OLLAMA_PATHS = "/api/"


def is_ollama(request: Request | None) -> bool:
    return request is not None and request.url.path.startswith(OLLAMA_PATHS)


def error_response(
    exc: CortexError, request: Request | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The error in the dialect of `request`'s path, with the error's own headers (`Retry-After`)."""
    if is_anthropic(request):
        body, status = anthropic_error_body(exc), anthropic_status(exc)
    elif is_ollama(request):
        body, status = ollama_error_body(exc), exc.status
    else:
        body, status = error_body(exc), exc.status
    _log_refusal(request, status, exc.message)
    _keep(request, status, exc.code)
    return JSONResponse(body, status_code=status, headers=exc.headers | (headers or {}))


def _log_refusal(request: Request | None, status: int, message: str) -> None:
    """Every 4xx the gateway answers, logged once at INFO with its request id and reason (5xx are
    logged where they are raised, at WARNING or with their traceback)."""
    if 400 <= status < 500:
        where = f"{request.method} {request.url.path}" if request is not None else "-"
        log.info(
            "request=%s key=%s %s → %d %s",
            request_id_var.get(),
            caller_var.get(),
            where,
            status,
            message,
        )


def _keep(request: Request | None, status: int, code: str) -> None:
    """The error on the dashboard's list of recent ones (gateway/http/dashboard.py)."""
    ctx = getattr(request.app.state, "ctx", None) if request is not None else None
    if ctx is not None:
        ctx.dashboard.error(
            status, code, request.method, request.url.path, request_id_var.get(), caller_var.get()
        )


def _field(loc: tuple[Any, ...]) -> str | None:
    """A field's path (`input.0.content.1`), without pydantic's labels of union members (`list[…]`)."""
    parts = [str(part) for part in (loc[1:] if loc and loc[0] == "body" else loc)]
    return ".".join(part for part in parts if "[" not in part) or None


def _problem(error: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic error → (message, param)."""
    if error["type"] == "json_invalid":
        return f"invalid JSON: {error.get('ctx', {}).get('error', 'cannot be parsed')}", None
    field = _field(tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {field}", field
    message = error["msg"].removeprefix("Value error, ")
    if field is None and error["type"] == "value_error" and ": " in message:  # a model validator's
        field, message = message.split(": ", 1)  # "top_logprobs: requires logprobs to be true"
    if field is None:
        return (
            "the request body must be a JSON object, sent with Content-Type: application/json",
            None,
        )
    return f"{field}: {message}", field


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    problems = [_problem(error) for error in exc.errors()]
    message = "; ".join(text for text, _ in problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        message += f" (and {len(problems) - MAX_LISTED} more)"
    return InvalidRequest(message, param=problems[0][1] if problems else None)


async def _on_cortex_error(request: Request, exc: CortexError) -> JSONResponse:
    if exc.status >= 500:
        path, request_id = request.url.path, request_id_var.get()
        log.warning(
            "request=%s key=%s %s %s → %d %s",
            request_id,
            caller_var.get(),
            request.method,
            path,
            exc.status,
            exc.message,
        )
    return error_response(exc, request)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc), request)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: RequestTooLarge.code}.get(
        exc.status_code, f"http_{exc.status_code}"
    )
    message = f"{exc.detail}: {request.method} {request.url.path}"
    if is_anthropic(request) or is_ollama(request):
        error = CortexError(message)
        error.status = exc.status_code
        return error_response(error, request, exc.headers)
    body = ErrorResponse(error=Error(message=message, type="invalid_request_error", code=code))
    _log_refusal(request, exc.status_code, message)
    _keep(request, exc.status_code, code)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


async def _on_redis_error(request: Request, exc: RedisError) -> JSONResponse:
    return await _on_cortex_error(request, broker_error(exc))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception(
        "request=%s key=%s %s %s failed",
        request_id_var.get(),
        caller_var.get(),
        request.method,
        request.url.path,
    )
    return error_response(CortexError(f"internal error: {type(exc).__name__}"), request)


def install(app: FastAPI) -> None:
    app.add_exception_handler(CortexError, _on_cortex_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(RedisError, _on_redis_error)
    app.add_exception_handler(Exception, _on_unexpected)
