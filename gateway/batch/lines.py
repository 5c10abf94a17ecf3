"""One batch input line → one output or error line (OpenAI's batch output format).

A line is `{"custom_id", "method": "POST", "url", "body"}`. It becomes one job in the `batch`
class on the model's job streams, gathered like a non-streaming request and rendered as the
endpoint would have answered it. A line that cannot be read fails alone, in the error file."""

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.dialects.errors import error_body
from gateway.dialects.gather import Gathered, gather_choices
from gateway.dialects.protocol.anthropic import MessageCreateParams
from gateway.dialects.protocol.embeddings import EmbeddingCreateParams
from gateway.dialects.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.dialects.protocol.openai_batch import (
    BatchLineError,
    BatchLineResponse,
    BatchOutputLine,
)
from gateway.dialects.render.chat import chat_completion
from gateway.dialects.render.completions import completion
from gateway.dialects.render.embeddings import embedding_response
from gateway.dialects.render.messages import message
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.jobs.job import Job
from gateway.jobs.pooling import embedded, submit_embedding
from gateway.jobs.submit import submit_request
from shared.errors import CortexError, InvalidRequest


@dataclass(frozen=True)
class Endpoint:
    request: type[BaseModel]  # a `gateway.jobs.job.ApiRequest`, or the embeddings request
    render: Callable[
        [Job, Any, Any], BaseModel | dict
    ]  # (job, request, result): as the endpoint answers it, not streamed (a dict: its JSON already)
    start: Callable[
        [JobContext, Any, Caller], Awaitable[Job]
    ] = (  # queue the line's job in the batch class
        lambda ctx, body, caller: submit_request(ctx, body, caller, job_class="batch")
    )
    result: Callable[[Job, Any], Awaitable[Any]] = (  # the job's result, once done (the job closed)
        lambda job, body: _gathered(job, getattr(body, "n", 1))
    )


async def _gathered(job: Job, n: int) -> Gathered:
    async with job:
        return await gather_choices(job.final_events(), n)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(
        ChatCompletionRequest, lambda job, _, g: chat_completion(job, g, job.parsers)
    ),
    "/v1/completions": Endpoint(CompletionRequest, lambda job, _, g: completion(job, g)),
    "/v1/embeddings": Endpoint(
        EmbeddingCreateParams,
        lambda job, body, result: embedding_response(
            body.model, result, body.encoding_format, arrays=False
        ),
        start=lambda ctx, body, caller: submit_embedding(
            ctx, caller, body.model, body.inputs, dimensions=body.dimensions, job_class="batch"
        ),
        result=lambda job, body: embedded(job),
    ),
    "/v1/messages": Endpoint(
        MessageCreateParams, lambda job, _, g: message(job, g.choices[0], g.usage, job.parsers())
    ),
}


class LineError(Exception):
    """The line itself is unusable (not JSON, wrong shape, wrong url, invalid body)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass
class ParsedLine:
    custom_id: str
    body: Any  # the endpoint's request model


def parse_line(raw: bytes, endpoint: str) -> ParsedLine:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LineError("invalid_json", f"the line is not JSON: {exc}") from None
    if not isinstance(line, dict):
        raise LineError(
            "invalid_request", "the line must be a JSON object with custom_id, method, url and body"
        )
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "the line has no custom_id (a non-empty string)")
    if line.get("method", "POST") != "POST":
        raise LineError(
            "invalid_method", f"method must be POST; got {line.get('method')!r}", custom_id
        )
    if line.get("url") != endpoint:
        raise LineError(
            "invalid_url",
            f"url must be the batch's endpoint {endpoint}; got {line.get('url')!r}",
            custom_id,
        )
    if endpoint not in ENDPOINTS:
        raise LineError(
            "unsupported_endpoint",
            f"{endpoint} is not served for batches by this worker yet",
            custom_id,
        )
    if not isinstance(line.get("body"), dict):
        raise LineError(
            "invalid_request", "body must be a JSON object: the request for the endpoint", custom_id
        )
    try:
        request = ENDPOINTS[endpoint].request
        body = request.model_validate(
            line["body"] | ({"stream": False} if "stream" in request.model_fields else {})
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise LineError("invalid_request", f"invalid body: {problems}", custom_id) from None
    return ParsedLine(custom_id, body)


async def start(ctx: JobContext, parsed: ParsedLine, caller: Caller, endpoint: str) -> Job:
    """Queue the line's job in the batch class as the batch key's, by the path every request takes."""
    return await ENDPOINTS[endpoint].start(ctx, parsed.body, caller)


async def finish(job: Job, parsed: ParsedLine, endpoint: str) -> BatchOutputLine:
    """Gather the job's result into the endpoint's response, as an output line."""
    result = await ENDPOINTS[endpoint].result(job, parsed.body)
    rendered = ENDPOINTS[endpoint].render(job, parsed.body, result)
    body = rendered if isinstance(rendered, dict) else rendered.model_dump(mode="json")
    response = BatchLineResponse(status_code=200, request_id=job.id, body=body)
    return BatchOutputLine(id=f"batch_req_{job.id}", custom_id=parsed.custom_id, response=response)


def failed_line(
    line_no: int, exc: LineError | CortexError, custom_id: str | None, job_id: str = ""
) -> BatchOutputLine:
    """An error-file line: a request the model refused carries its HTTP status and error body;
    an unusable line carries just the error."""
    line_id = f"batch_req_{job_id or f'line{line_no}'}"
    if isinstance(exc, LineError):
        return BatchOutputLine(
            id=line_id,
            custom_id=exc.custom_id or custom_id,
            error=BatchLineError(code=exc.code, message=f"line {line_no + 1}: {exc.message}"),
        )
    response = BatchLineResponse(status_code=exc.status, request_id=job_id, body=error_body(exc))
    return BatchOutputLine(id=line_id, custom_id=custom_id, response=response)


__all__ = [
    "ENDPOINTS",
    "InvalidRequest",
    "LineError",
    "ParsedLine",
    "failed_line",
    "finish",
    "parse_line",
    "start",
]
