"""What a scrape of `/metrics` without the admin key sees once auth is on (keys exist, or the gateway
listens beyond loopback), field by field:

- per API key (`cortex:key_*`, labelled `key`): nothing; key names and each key's usage are the
  tenants' business;
- per node and device (`node`, `device` labels): summed over them, so the fleet's figures per model
  stay (requests, latencies, tokens, slots, memory, prefix cache counters) but no host or device is
  named;
- per-replica ratios (`vllm:kv_cache_usage_perc`): nothing, as their sum means nothing.
The admin key, and anyone while auth is off, sees every series as it is; `metrics_require_admin_key`
refuses anyone else (gateway/http/auth.py `metrics_access`)."""

from prometheus_client.metrics_core import Metric

from gateway.metrics import Metrics

FOLDED_LABELS = frozenset({"node", "device"})
PER_REPLICA_RATIOS = frozenset({"vllm:kv_cache_usage_perc"})
CREATED = "_created"  # a counter's or histogram's start time: the earliest, not a sum


class AnonymousView:
    """The gateway's metrics as a scrape without the admin key sees them (a collector `generate_latest` takes)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        for family in self.metrics.registry.collect():
            if family.name in self.metrics.per_key or family.name in PER_REPLICA_RATIOS:
                continue
            labels = {name for sample in family.samples for name in sample.labels}
            yield _folded(family) if labels & FOLDED_LABELS else family


def _folded(family: Metric) -> Metric:
    """`family` with its `node` and `device` labels summed away."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        key = (
            sample.name,
            tuple((k, v) for k, v in sample.labels.items() if k not in FOLDED_LABELS),
        )
        earlier = values.get(key)
        if earlier is None:
            values[key] = sample.value
        else:
            values[key] = (
                min(earlier, sample.value)
                if sample.name.endswith(CREATED)
                else earlier + sample.value
            )
    folded = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in values.items():
        folded.add_sample(name, dict(labels), value)
    return folded
