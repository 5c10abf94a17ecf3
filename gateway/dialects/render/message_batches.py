"""A Cortex batch of `/v1/messages` lines → Anthropic's `message_batch` object and its results
lines. No I/O: the route reads the batch, its input and its output files."""

import json
from datetime import UTC, datetime

from gateway.dialects.errors import ANTHROPIC_TYPES
from gateway.dialects.protocol.anthropic import ErrorDetail, ErrorResponse, Message
from gateway.dialects.protocol.anthropic_batch import (
    MessageBatch,
    MessageBatchCanceledResult,
    MessageBatchErroredResult,
    MessageBatchExpiredResult,
    MessageBatchIndividualResponse,
    MessageBatchRequestCounts,
    MessageBatchSucceededResult,
)
from gateway.dialects.protocol.openai_batch import TERMINAL, Batch, BatchOutputLine

ENDPOINT = "/v1/messages"
_PROCESSING_STATUS = {"cancelling": "canceling"}  # every other unfinished status is in_progress


def _time(unix_s: int | None) -> str | None:
    return (
        datetime.fromtimestamp(unix_s, UTC).isoformat().replace("+00:00", "Z")
        if unix_s is not None
        else None
    )


def _counts(batch: Batch) -> MessageBatchRequestCounts:
    """Requests count as processing until the whole batch has ended (as Anthropic's do)."""
    c = batch.request_counts
    if batch.status not in TERMINAL:
        return MessageBatchRequestCounts(processing=c.total)
    rest = max(c.total - c.completed - c.failed, 0)
    return MessageBatchRequestCounts(
        succeeded=c.completed,
        errored=c.failed + (rest if batch.status == "failed" else 0),
        canceled=rest if batch.status == "cancelled" else 0,
        expired=rest if batch.status == "expired" else 0,
    )


def message_batch(batch: Batch, results_url: str) -> MessageBatch:
    ended = batch.status in TERMINAL
    return MessageBatch(
        id=batch.id,
        processing_status="ended" if ended else _PROCESSING_STATUS.get(batch.status, "in_progress"),
        request_counts=_counts(batch),
        ended_at=_time(
            batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
        ),
        created_at=_time(batch.created_at),
        expires_at=_time(batch.expires_at or batch.created_at),
        cancel_initiated_at=_time(batch.cancelling_at),
        results_url=results_url if ended else None,
    )


def _errored(line: BatchOutputLine) -> MessageBatchErroredResult:
    if line.response is not None:  # the model refused it: its status and message
        kind = ANTHROPIC_TYPES.get(line.response.status_code, "api_error")
        message = line.response.body.get("error", {}).get("message", "")
    else:  # the line itself was unusable
        kind, message = "invalid_request_error", line.error.message if line.error else ""
    return MessageBatchErroredResult(
        error=ErrorResponse(error=ErrorDetail(type=kind, message=message))
    )


def results(
    batch: Batch, custom_ids: list[str], output: bytes, errors: bytes
) -> list[MessageBatchIndividualResponse]:
    """One result per request: succeeded and errored ones from the batch's files, then the
    requests that never ran, canceled or expired with the batch."""
    found: dict[str, MessageBatchIndividualResponse] = {}
    for raw in output.splitlines():
        line = BatchOutputLine.model_validate_json(raw)
        message = Message.model_validate(line.response.body)
        found[line.custom_id] = MessageBatchIndividualResponse(
            custom_id=line.custom_id, result=MessageBatchSucceededResult(message=message)
        )
    for raw in errors.splitlines():
        line = BatchOutputLine.model_validate_json(raw)
        if line.custom_id is not None:
            found[line.custom_id] = MessageBatchIndividualResponse(
                custom_id=line.custom_id, result=_errored(line)
            )
    never_ran = {
        "expired": MessageBatchExpiredResult(),
        "failed": MessageBatchErroredResult(
            error=ErrorResponse(
                error=ErrorDetail(
                    type="api_error", message="the batch failed before this request ran"
                )
            )
        ),
    }.get(batch.status, MessageBatchCanceledResult())
    for custom_id in custom_ids:
        found.setdefault(
            custom_id, MessageBatchIndividualResponse(custom_id=custom_id, result=never_ran)
        )
    return [found[c] for c in custom_ids if c in found]


def input_lines(requests: list[tuple[str, dict]]) -> bytes:
    """A message batch's requests as the input file of a `/v1/messages` batch."""
    return b"".join(
        json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": params}
        ).encode()
        + b"\n"
        for custom_id, params in requests
    )


def custom_ids(content: bytes) -> list[str]:
    """The custom ids of an input file written by `input_lines`, in order."""
    return [json.loads(line)["custom_id"] for line in content.splitlines() if line.strip()]
