"""A `CortexError` as each dialect's error body: OpenAI's `{"error": {"message", "type", "param",
"code"}}`, Anthropic's `{"type": "error", "error": {"type", "message"}}` (with its own status for a
few), Ollama's `{"error": "..."}`, their messages without URLs or local paths (`for_clients`). Which one a request gets, and the status, is gateway/http/errors.py;
streams and batch lines carry the same bodies."""

import re
from typing import Any

from gateway.dialects.protocol import anthropic, ollama
from gateway.dialects.protocol.openai import Error, ErrorResponse
from shared.errors import CortexError

# What a message from a node or Redis may carry that is nobody's business but the operator's (who
# finds it in the gateway's and the node's logs): URLs (a peer's, Redis's) and absolute paths on a
# host, but not the API's own routes (/v1/…, /api/…).
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>()]+")
_LOCAL_PATH = re.compile(
    r"(?<![\w.:/~-])~?/(?!(?:v1|api|admin|health|metrics)\b)[\w.@+-]+(?:/[\w.@+-]*)+"
)


def for_clients(message: str) -> str:
    """`message` with URLs and local paths replaced by what they are, as every error body has it."""
    return _LOCAL_PATH.sub("<path>", _URL.sub("<url>", message))


def error_body(exc: CortexError) -> dict[str, Any]:
    message = for_clients(exc.message)
    error = Error(message=message, type=exc.type, param=exc.param, code=exc.code)
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
        error=anthropic.ErrorDetail(type=kind, message=for_clients(exc.message))
    ).model_dump()


def ollama_error_body(exc: CortexError) -> dict[str, Any]:
    return ollama.ErrorResponse(error=for_clients(exc.message)).model_dump()
