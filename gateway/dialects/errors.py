"""A `CortexError` as each dialect's error body: OpenAI's `{"error": {"message", "type", "param",
"code"}}`, Anthropic's `{"type": "error", "error": {"type", "message"}}` (with its own status for a
few), Ollama's `{"error": "..."}`. Which one a request gets, and the status, is gateway/http/errors.py;
streams and batch lines carry the same bodies."""

from typing import Any

from gateway.dialects.protocol import anthropic, ollama
from gateway.dialects.protocol.openai import Error, ErrorResponse
from shared.errors import CortexError


def error_body(exc: CortexError) -> dict[str, Any]:
    error = Error(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    return ErrorResponse(error=error).model_dump()


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_status(exc: CortexError) -> int:
    return exc.anthropic_status or exc.status


def anthropic_error_body(exc: CortexError) -> dict[str, Any]:
    status = anthropic_status(exc)
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return anthropic.ErrorResponse(
        error=anthropic.ErrorDetail(type=kind, message=exc.message)
    ).model_dump()


def ollama_error_body(exc: CortexError) -> dict[str, Any]:
    return ollama.ErrorResponse(error=exc.message).model_dump()
