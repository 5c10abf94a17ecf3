"""Prometheus metrics, named in vLLM's style under the `cortex:` prefix; the KV cache's, prefix
cache's and speculative decoding's under vLLM's own names (`vllm:`).

Per-request figures are observed as a job's events arrive (one observation per engine step, not
per token); fleet gauges, and the nodes' own counters, are refreshed from heartbeats and streams
every `REFRESH_S`."""

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.fleet import Fleet
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.wire import DeltaEvent, DoneEvent, Usage

log = logging.getLogger(__name__)

REFRESH_S = 2.0
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        per_request = ["model", "node"]
        h = lambda name, doc, buckets=_LATENCY_BUCKETS: Histogram(
            f"cortex:{name}", doc, per_request, buckets=buckets, registry=self.registry
        )
        self.ttft = h("time_to_first_token_seconds", "Time from submission to the first token.")
        self.itl = h(
            "inter_token_latency_seconds", "Time between successive token deliveries.", _ITL_BUCKETS
        )
        self.e2e = h("e2e_request_latency_seconds", "Time from submission to the last token.")
        self.queue = h(
            "request_queue_time_seconds", "Time a job waited before an engine admitted it."
        )
        c = lambda name, doc, labels=per_request: Counter(
            f"cortex:{name}", doc, labels, registry=self.registry
        )
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.success = c(
            "request_success", "Requests finished, by reason.", ["model", "node", "finished_reason"]
        )
        self.pooled_inputs = c("pooled_inputs", "Inputs of finished embedding and rerank jobs.")
        self.pooled_forwards = c(
            "pooled_forwards",
            "Forward passes that finished embedding and rerank jobs took "
            "(per job: a pass shared by several jobs counts in each).",
        )
        # per API key, by its name (never its secret)
        self.key_requests = c("key_requests", "Requests admitted, per API key.", ["key"])
        self.key_rejections = c(
            "key_rejections", "Requests refused by a key's limits, by limit.", ["key", "limit"]
        )
        self.key_prompt_tokens = c(
            "key_prompt_tokens",
            "Prompt tokens of finished jobs this gateway delivered, per "
            "API key (what each key was charged, cancelled and failed jobs too, is in "
            "`cortex keys show`).",
            ["key"],
        )
        self.key_completion_tokens = c(
            "key_completion_tokens",
            "Tokens generated for finished jobs this gateway delivered, per API key.",
            ["key"],
        )
        self.per_key = frozenset(
            family.name
            for metric in (
                self.key_requests,
                self.key_rejections,
                self.key_prompt_tokens,
                self.key_completion_tokens,
            )
            for family in metric.describe()
        )
        g = lambda name, doc, labels: Gauge(f"cortex:{name}", doc, labels, registry=self.registry)
        self.running = g("requests_running", "Jobs read by a node and not finished.", ["model"])
        self.waiting = g("requests_waiting", "Jobs queued and not yet read by any node.", ["model"])
        self.memory_used = g(
            "node_memory_used_bytes", "Device memory in use, from heartbeats.", ["node", "device"]
        )
        self.memory_total = g(
            "node_memory_total_bytes", "Device memory, from heartbeats.", ["node", "device"]
        )
        self.slots_used = g("model_slots_used", "Slots taken, from heartbeats.", ["model", "node"])
        self.slots_total = g("model_slots_total", "Slots, from heartbeats.", ["model", "node"])
        self.prefix_hit_rate = g(
            "prefix_cache_hit_rate",
            "Prompt tokens found in prefix caches over those looked "
            "up, all replicas of the model together (their counters since they started).",
            ["model"],
        )
        self.replicas = ReplicaCollector()
        self.registry.register(self.replicas)
        self.routing = RoutingCollector()
        self.registry.register(self.routing)

    def key_tokens(self, key: str, usage: Usage) -> None:
        self.key_prompt_tokens.labels(key).inc(usage.prompt_tokens)
        self.key_completion_tokens.labels(key).inc(usage.completion_tokens)

    def request(self, model: str, submitted: float, streamed: bool = True) -> "RequestTimer":
        return RequestTimer(self, model, submitted, streamed)

    async def refresh(self, fleet: Fleet, models: set[str]) -> None:
        nodes = await fleet.live_nodes(fresh=True)
        self.replicas.update(nodes)
        for gauge in (self.memory_used, self.memory_total, self.slots_used, self.slots_total):
            gauge.clear()
        for node in nodes:
            for device in node.devices:
                self.memory_total.labels(node.node, device.id).set(device.total_mb << 20)
                self.memory_used.labels(node.node, device.id).set(
                    (device.total_mb - device.free_mb) << 20
                )
            for model, info in node.models.items():
                self.slots_used.labels(model, node.node).set(info.slots_used)
                self.slots_total.labels(model, node.node).set(info.slots_total)
        found = await fleet.queues(models, nodes)
        self.routing.routed = {q.model: q.routed for q in found}
        self.prefix_hit_rate.clear()
        for q in found:
            self.running.labels(q.model).set(q.running)
            self.waiting.labels(q.model).set(sum(q.queued.values()))
            if q.prefix_hit_rate is not None:
                self.prefix_hit_rate.labels(q.model).set(q.prefix_hit_rate)

    async def refresh_forever(
        self, fleet: Fleet, models: set[str], sampled: Callable[["Metrics"], None]
    ) -> None:
        """Refresh the fleet's gauges every REFRESH_S, handing each refresh to `sampled` (the
        dashboard's history)."""
        while True:
            try:
                await self.refresh(fleet, models)
            except Exception as exc:  # Redis away: the gauges keep their last values
                log.debug("metrics refresh: %s", exc)
            sampled(self)
            await asyncio.sleep(REFRESH_S)


_COUNTERS = (  # (name, ModelInfo part, its field, help); exposed with `_total` appended
    (
        "vllm:prefix_cache_queries",
        "kv",
        "prefix_queries",
        "Prefix cache queries, in prompt tokens looked up.",
    ),
    (
        "vllm:prefix_cache_hits",
        "kv",
        "prefix_hits",
        "Prefix cache hits, in prompt tokens found cached.",
    ),
    (
        "vllm:num_preemptions",
        "kv",
        "preemptions",
        "Sequences preempted (recomputed later) for lack of KV blocks.",
    ),
    (
        "vllm:spec_decode_num_drafts",
        "spec",
        "drafts",
        "Speculative decoding: steps of a sequence that checked a draft.",
    ),
    (
        "vllm:spec_decode_num_draft_tokens",
        "spec",
        "draft_tokens",
        "Speculative decoding: draft tokens checked.",
    ),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "spec",
        "accepted_tokens",
        "Speculative decoding: draft tokens accepted.",
    ),
)


class ReplicaCollector:
    """Each replica's KV cache, prefix cache and speculative decoding, from the latest heartbeats,
    labelled model and node.

    The counters are the node's own, exposed as they are (not counted here): a replica that restarts
    starts them again from zero, which Prometheus reads as a counter reset."""

    def __init__(self) -> None:
        self.replicas: dict[tuple[str, str], ModelInfo] = {}  # (model, node) -> its latest figures

    def update(self, nodes: list[NodeHeartbeat]) -> None:
        self.replicas = {
            (model, node.node): info
            for node in nodes
            for model, info in node.models.items()
            if info.kv is not None
        }

    def collect(self):
        labels = ["model", "node"]
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV cache usage, 0..1: blocks held by running sequences"
            " over the pool (blocks only holding a cached prefix are free).",
            labels=labels,
        )
        counters = [
            (CounterMetricFamily(name, doc, labels=labels), part, field)
            for name, part, field, doc in _COUNTERS
        ]
        tier_hits = CounterMetricFamily(
            "cortex:kv_cache_tier_hits",
            "Prefix cache hits by the tier the blocks came from, in prompt tokens: device (in the"
            " pool), host (copied back from host memory), disk (read back from the disk tier).",
            labels=[*labels, "tier"],
        )
        tier_bytes = CounterMetricFamily(
            "cortex:kv_cache_tier_bytes",
            "KV bytes moved between the tiers: offloaded (device to host), restored (host to"
            " device), disk_written, disk_read.",
            labels=[*labels, "copy"],
        )
        tier_blocks = GaugeMetricFamily(
            "cortex:kv_cache_tier_blocks",
            "KV blocks kept below the device: host_used and host_total (host-memory slots),"
            " disk (blocks on disk).",
            labels=[*labels, "tier"],
        )
        for (model, node), info in self.replicas.items():
            kv = info.kv
            usage.add_metric([model, node], kv.usage)
            for family, part, field in counters:
                if (stats := getattr(info, part)) is not None:
                    family.add_metric([model, node], getattr(stats, field))
            if not (kv.host_blocks_total or kv.disk_blocks or kv.disk_hits):
                continue  # no tier below the device
            device = kv.prefix_hits - kv.host_hits - kv.disk_hits
            for tier, hits in (("device", device), ("host", kv.host_hits), ("disk", kv.disk_hits)):
                tier_hits.add_metric([model, node, tier], hits)
            for copy in ("offloaded", "restored", "disk_written", "disk_read"):
                tier_bytes.add_metric([model, node, copy], getattr(kv, f"{copy}_bytes"))
            for tier, blocks in (
                ("host_used", kv.host_blocks_used),
                ("host_total", kv.host_blocks_total),
                ("disk", kv.disk_blocks),
            ):
                tier_blocks.add_metric([model, node, tier], blocks)
        yield usage
        for family, _, _ in counters:
            yield family
        yield from (tier_hits, tier_bytes, tier_blocks)


class RoutingCollector:
    """`cortex:routed_jobs_total{model, outcome}`: jobs by how the gateways routed them, fleet-wide
    (every gateway counts in `Keys.routing`; see gateway/fleet/routing.py for the outcomes)."""

    def __init__(self) -> None:
        self.routed: dict[str, dict[str, int]] = {}  # model -> outcome -> jobs

    def collect(self):
        family = CounterMetricFamily(
            "cortex:routed_jobs",
            "Jobs by routing outcome: cache (to the node holding their "
            "prefix), session (to where their session last ran), full (such a node had no "
            "room), shared (nothing to route by), moved (left a node's own stream unserved).",
            labels=["model", "outcome"],
        )
        for model, counts in self.routed.items():
            for outcome, jobs in counts.items():
                family.add_metric([model, outcome], jobs)
        yield family


class RequestTimer:
    """Observes one job's events. A job not streamed comes in joined deltas (NodeSettings.whole_flush_s):
    its time to first token is the node's (queued + prefill, from the done event's timings), and its
    inter-token latency its decode time over its tokens, observed once per gap."""

    def __init__(self, metrics: Metrics, model: str, submitted: float, streamed: bool = True):
        self.metrics, self.model, self.submitted = metrics, model, submitted
        self.streamed = streamed
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.finish_reason = "stop"

    def on_event(self, event: DeltaEvent | DoneEvent) -> None:
        now = time.monotonic()
        if isinstance(event, DeltaEvent):
            if self.last is not None:
                self.gaps.append(now - self.last)
            self.first = self.first or now
            self.last = now
            self.finish_reason = next(
                (c.finish_reason for c in event.choices if c.finish_reason), self.finish_reason
            )
            return
        m, node = self.metrics, event.node or "?"
        labels = (self.model, node)
        if event.pooled is not None:
            m.pooled_inputs.labels(*labels).inc(
                len(event.pooled.vectors) + len(event.pooled.scores)
            )
            m.pooled_forwards.labels(*labels).inc(event.pooled.forwards)
        elif self.streamed:
            m.ttft.labels(*labels).observe((self.first or now) - self.submitted)
        else:
            m.ttft.labels(*labels).observe(
                (event.timings.queue_ms + event.timings.prefill_ms) / 1000
            )
            gaps = event.usage.completion_tokens - 1
            self.gaps = [event.timings.decode_ms / 1000 / gaps] * gaps if gaps > 0 else []
        m.e2e.labels(*labels).observe(now - self.submitted)
        m.queue.labels(*labels).observe(event.timings.queue_ms / 1000)
        itl = m.itl.labels(*labels)
        for gap in self.gaps:
            itl.observe(gap)
        m.prompt_tokens.labels(*labels).inc(event.usage.prompt_tokens)
        m.generation_tokens.labels(*labels).inc(event.usage.completion_tokens)
        m.success.labels(self.model, node, self.finish_reason).inc()
