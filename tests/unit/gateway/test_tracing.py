"""The gateway's spans (gateway/tracing.py): one trace per API request with admission, placement and
the queue wait under the request's span, its context carried in the job, its id in the response's
`x-trace-id` header and in the request's log lines; a client's own trace is continued; with tracing
off nothing of it shows. (The node's side: tests/integration/test_tracing.py.)"""

import io
import logging

from gateway.http.server import LOG_FORMAT
from gateway.tracing import TraceLogFormatter
from tests.unit.gateway.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def by_name(spans) -> dict:
    finished = spans.get_finished_spans()
    named = {span.name: span for span in finished}
    assert len(named) == len(finished), [span.name for span in finished]  # each once
    return named


async def test_a_request_is_one_trace_its_job_carries(client, node, spans):
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text

    named = by_name(spans)
    assert set(named) == {"POST /v1/chat/completions", "admission", "placement", "queue wait"}
    root = named["POST /v1/chat/completions"]
    trace_id = f"{root.context.trace_id:032x}"
    assert root.parent is None and root.instrumentation_scope.name == "cortex.gateway"
    assert response.headers["x-trace-id"] == trace_id
    for name in ("admission", "placement", "queue wait"):
        assert named[name].parent.span_id == root.context.span_id
        assert named[name].context.trace_id == root.context.trace_id
    assert (
        named["admission"].end_time
        <= named["placement"].start_time
        <= named["queue wait"].start_time
    )
    [entry] = node.entries
    version, carried_trace, parent, flags = entry.traceparent.split(
        "-"
    )  # the node's spans hang under the request's
    assert (version, carried_trace, parent) == (
        "00",
        trace_id,
        f"{root.context.span_id:016x}",
    ) and int(flags, 16) & 1
    assert root.attributes["cortex.job"] == entry.job and root.attributes["cortex.model"] == MODEL
    assert (
        root.attributes["cortex.node"] == "n1"
        and root.attributes["gen_ai.usage.output_tokens"] == 3
    )
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["cortex.request_id"] == response.headers["x-request-id"]


async def test_a_client_trace_is_continued(client, node, spans):
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    response = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"traceparent": traceparent}
    )
    assert response.headers["x-trace-id"] == CLIENT_TRACE
    root = by_name(spans)["POST /v1/chat/completions"]
    assert (
        f"{root.parent.span_id:016x}" == CLIENT_SPAN
        and f"{root.context.trace_id:032x}" == CLIENT_TRACE
    )
    assert node.entries[0].traceparent.startswith(f"00-{CLIENT_TRACE}-")


async def test_a_refused_request_is_traced_with_its_status(client, spans):
    response = await client.post("/v1/chat/completions", json=CHAT | {"model": "no-such-model"})
    assert response.status_code == 404
    named = by_name(spans)
    assert set(named) == {"POST /v1/chat/completions", "admission"}
    assert named["POST /v1/chat/completions"].attributes["http.response.status_code"] == 404
    assert not named["admission"].status.is_ok  # it raised model_not_found
    assert response.headers["x-trace-id"] == f"{named['admission'].context.trace_id:032x}"


async def test_only_the_api_is_traced(client, spans):
    for path in ("/health", "/metrics"):
        response = await client.get(path)
        assert response.status_code == 200 and "x-trace-id" not in response.headers
    assert spans.get_finished_spans() == ()
    await client.get(f"/v1/models/{MODEL}")
    assert [span.name for span in spans.get_finished_spans()] == [
        "GET /v1/models/{model_id:path}"
    ]  # its route


async def test_the_request_log_lines_name_the_trace(client, node, spans, caplog):
    caplog.set_level(logging.INFO, logger="gateway")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TraceLogFormatter(LOG_FORMAT))
    logger = logging.getLogger("gateway")
    logger.addHandler(handler)
    try:
        response = await client.post("/v1/chat/completions", json=CHAT)
        logger.info("not about a request")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    request_lines = [
        line for line in lines if f"request={response.headers['x-request-id']}" in line
    ]
    assert len(request_lines) >= 2  # queued, done
    assert all(
        line.endswith(f" trace={response.headers['x-trace-id']}") for line in request_lines
    ), request_lines
    assert lines[-1].endswith("not about a request")


async def test_with_tracing_off_nothing_shows(client, node):
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and "x-trace-id" not in response.headers
    assert node.entries[0].traceparent is None
