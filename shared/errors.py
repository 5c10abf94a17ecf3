"""Typed errors. Each carries its HTTP status and a stable code; this is the only place
where an error kind is mapped to a status. Nodes send the code in an error event and the
gateway rebuilds the same error from it with `error_from_code`."""

import math
from typing import ClassVar


class CortexError(Exception):
    status: ClassVar[int] = 500
    anthropic_status: ClassVar[int | None] = (
        None  # the status under /v1/messages, where Anthropic's differs
    )
    code: ClassVar[str] = "internal_error"
    type: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers the response carries besides the body."""
        return {}


class InvalidRequest(CortexError):
    status, code, type = 400, "invalid_request", "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class WrongModelKind(InvalidRequest):
    """A request for what the model does not serve: chat on an embedding model, embeddings on a chat model."""

    code = "model_not_supported"


class PreviousResponseNotFound(InvalidRequest):
    code = "previous_response_not_found"


class ModelNotFound(CortexError):
    status, code, type = 404, "model_not_found", "invalid_request_error"


class ModelNotAllowed(ModelNotFound):
    """The caller's API key may not use the model: OpenAI words it as a model that does not exist
    (404), Anthropic as a permission error (403)."""

    anthropic_status = 403


class NotFound(CortexError):
    """A file or batch id that does not exist (or no longer)."""

    status, code, type = 404, "not_found", "invalid_request_error"


class Unauthorized(CortexError):
    status, code, type = 401, "invalid_api_key", "authentication_error"


class Conflict(CortexError):
    """Something of that name exists already (an API key)."""

    status, code, type = 409, "conflict", "invalid_request_error"


class Forbidden(CortexError):
    status, code, type = 403, "forbidden", "permission_error"


class RateLimited(CortexError):
    """Over the key's requests per minute; `retry_after_s` is when a request would be admitted."""

    status, code, type = 429, "rate_limit_exceeded", "requests"

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        self.retry_after = max(
            1, math.ceil(retry_after_s)
        )  # whole seconds, as Retry-After carries them
        super().__init__(f"{message}; try again in {self.retry_after}s")

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class TokensRateLimited(RateLimited):
    """Over the key's tokens per minute (counted from finished jobs' real usage)."""

    type = "tokens"


class DailyBudgetExceeded(RateLimited):
    """The key used its tokens for the day (UTC)."""

    code, type = "daily_budget_exceeded", "tokens"


class PayloadTooLarge(CortexError):
    status, code, type = 413, "file_too_large", "invalid_request_error"


class RequestTooLarge(PayloadTooLarge):
    """A request body over `max_request_bytes`."""

    code = "request_too_large"


class FilesQuotaExceeded(PayloadTooLarge):
    """Storing a file would bring every file kept past `files_max_total_bytes`."""

    code = "files_quota_exceeded"


class ModelUnavailable(CortexError):
    """No live node serves (or can load) the model."""

    status, code, type = 503, "model_unavailable", "service_unavailable"


class InsufficientMemory(ModelUnavailable):
    code = "insufficient_memory"


class ModelLoadFailed(ModelUnavailable):
    code = "model_load_failed"


class InsufficientCapacity(ModelUnavailable):
    """No live node can fit the model, even after evicting idle unpinned ones."""

    code = "insufficient_capacity"


class ModelPoisoned(ModelUnavailable):
    code = "model_poisoned"


class ModelPullFailed(ModelUnavailable):
    """A node could not fetch a model's files (from a peer node or the hub)."""

    code = "model_pull_failed"


class ModelFileCorrupt(ModelPullFailed):
    """A fetched file's size or hash is not what the hub's metadata says: it was deleted, never loaded."""

    code = "model_file_corrupt"


class DiskBudgetExceeded(ModelPullFailed):
    """A pull does not fit the node's `models_disk_gb`, even after evicting every idle model's files."""

    code = "insufficient_disk"


class NodeLost(CortexError):
    status, code, type = 503, "node_lost", "service_unavailable"


class BrokerUnavailable(CortexError):
    status, code, type = 503, "broker_unavailable", "service_unavailable"


class RedisUnreachable(BrokerUnavailable):
    """No answer from Redis (restarting, or the network gone): a new request waits for it to come
    back (gateway/bus/outage.py) before it is refused."""


class BrokerOutOfMemory(BrokerUnavailable):
    """Redis answers but refuses writes: it reached its `maxmemory` (policy `noeviction`)."""

    code = "redis_out_of_memory"


class BrokerReadOnly(BrokerUnavailable):
    """Redis answers but refuses writes: it is a read-only replica."""

    code = "redis_read_only"


class BrokerCannotPersist(BrokerUnavailable):
    """Redis answers but refuses writes: it could not write its snapshot or append-only file to disk."""

    code = "redis_cannot_persist"


class JobCancelled(CortexError):
    """Someone (an operator, a shutdown) cancelled the job while a client still waited for it."""

    status, code, type = 503, "cancelled", "service_unavailable"


class GenerationFailed(CortexError):
    status, code, type = 500, "generation_failed", "server_error"


class Timeout(CortexError):
    status, code, type = 504, "timeout", "server_error"


def _all_subclasses(cls: type[CortexError]) -> list[type[CortexError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


_BY_CODE: dict[str, type[CortexError]] = {}
for _cls in [CortexError, *_all_subclasses(CortexError)]:
    _BY_CODE.setdefault(_cls.code, _cls)  # a code shared with a subclass means the parent


def error_from_code(code: str, message: str) -> CortexError:
    """Rebuild the typed error a node reported; unknown codes become a plain server error."""
    return _BY_CODE.get(code, CortexError)(message)
