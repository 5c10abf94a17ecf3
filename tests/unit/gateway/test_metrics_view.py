"""What a scrape of /metrics without the admin key sees (gateway/http/metrics_view.py). No I/O."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.metrics_view import AnonymousView
from gateway.metrics import Metrics


def _samples(text: bytes) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_series_per_node_and_device_are_summed_and_those_per_key_or_per_replica_ratio_left_out():
    metrics = Metrics()
    metrics.e2e.labels("m", "host-1").observe(0.2)
    metrics.e2e.labels("m", "host-2").observe(3.0)
    metrics.memory_total.labels("host-1", "cuda:0").set(80)
    metrics.memory_total.labels("host-2", "cuda:1").set(40)
    metrics.key_requests.labels("alice").inc()
    seen = _samples(generate_latest(AnonymousView(metrics)))
    text = repr(seen)
    assert (
        "host-" not in text
        and "cuda" not in text
        and "alice" not in text
        and "cortex:key_" not in text
    )
    assert seen["cortex:e2e_request_latency_seconds_count", frozenset({("model", "m")})] == 2
    assert (
        seen[
            "cortex:e2e_request_latency_seconds_bucket", frozenset({("model", "m"), ("le", "0.25")})
        ]
        == 1
    )
    assert seen["cortex:e2e_request_latency_seconds_sum", frozenset({("model", "m")})] == 3.2
    assert seen["cortex:node_memory_total_bytes", frozenset()] == 120
    everything = _samples(generate_latest(metrics.registry))
    assert everything["cortex:key_requests_total", frozenset({("key", "alice")})] == 1
