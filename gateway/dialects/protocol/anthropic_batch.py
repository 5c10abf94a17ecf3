"""Anthropic's Message Batches API objects, named and ordered as the spec names them. A message
batch runs as a Cortex batch with endpoint `/v1/messages` (gateway/batch), so these are views of
it (gateway/dialects/render/message_batches.py)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.dialects.protocol.anthropic import ErrorResponse, Message


class MessageBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    params: dict[
        str, Any
    ]  # a `MessageCreateParams`, validated when its line runs: a bad one fails alone


class MessageBatchCreateParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=100_000)


class MessageBatchRequestCounts(BaseModel):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    ended_at: str | None = None  # RFC 3339
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None = None
    results_url: str | None = None


class MessageBatchList(BaseModel):
    data: list[MessageBatch]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class MessageBatchSucceededResult(BaseModel):
    type: Literal["succeeded"] = "succeeded"
    message: Message


class MessageBatchErroredResult(BaseModel):
    type: Literal["errored"] = "errored"
    error: ErrorResponse


class MessageBatchCanceledResult(BaseModel):
    type: Literal["canceled"] = "canceled"


class MessageBatchExpiredResult(BaseModel):
    type: Literal["expired"] = "expired"


MessageBatchResult = (
    MessageBatchSucceededResult
    | MessageBatchErroredResult
    | MessageBatchCanceledResult
    | MessageBatchExpiredResult
)


class MessageBatchIndividualResponse(BaseModel):
    """One line of a message batch's results."""

    custom_id: str
    result: MessageBatchResult
