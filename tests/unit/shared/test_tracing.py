"""Tracing's set-up (shared/tracing.py): off without an endpoint; with one, spans reach a real OTLP/HTTP
receiver (a small HTTP server here that decodes what the SDK's exporter posts) under the service's name."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from shared import tracing


@pytest.fixture
def receiver():
    """An OTLP/HTTP receiver on a free loopback port: yields (its base URL, the requests it got as (path, body))."""
    got: list[tuple[str, ExportTraceServiceRequest]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", got
    server.shutdown()
    server.server_close()


def test_no_endpoint_leaves_tracing_off():
    assert tracing.configure("cortex-gateway", "") is None
    assert tracing.tracer("cortex.gateway") is None


@pytest.mark.parametrize(
    "given, url",
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example/v1/traces", "https://otel.example/v1/traces"),
    ],
)
def test_the_traces_path_goes_below_a_base_url(given, url):
    assert tracing.traces_url(given) == url


def test_spans_reach_an_otlp_receiver_as_the_service(receiver):
    base_url, got = receiver
    provider = tracing.configure("cortex-node", base_url, instance="node-7")
    try:
        with tracing.tracer("cortex.node").start_as_current_span("node job") as span:
            assert tracing.traceparent(span).startswith(f"00-{tracing.trace_id(span)}-")
        assert provider.force_flush()
    finally:
        tracing.install(None)
        provider.shutdown()
    [(path, request)] = got
    assert path == "/v1/traces"
    [resource_spans] = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "cortex-node" and resource["service.instance.id"] == "node-7"
    [scope_spans] = resource_spans.scope_spans
    assert scope_spans.scope.name == "cortex.node" and [s.name for s in scope_spans.spans] == [
        "node job"
    ]
    assert scope_spans.spans[0].trace_id.hex() == tracing.trace_id(span)


def test_a_span_that_is_not_real_carries_nothing():
    assert (
        tracing.traceparent(trace.INVALID_SPAN) is None
        and tracing.trace_id(trace.INVALID_SPAN) == ""
    )
    assert not tracing.parent_context(
        {"traceparent": "garbage"}
    )  # a malformed one starts a new trace
