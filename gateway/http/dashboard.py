"""The operator's live picture (`/dashboard`): what its page polls. The fleet as `cortex status`
sees it (shared/fleet.Fleet.status: nodes, devices, models with their slots and KV cache, queues),
this gateway's own throughput, TTFT and queue depths over the last minutes (sampled from its
metrics at each refresh), and the last errors it answered (status, code, route, request id: never
a prompt, a message text or a key's secret)."""

import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

HISTORY_POINTS = 150  # 5 minutes at the metrics refresh (2 s)
ERRORS_KEPT = 20


def _total(metric: Counter | Histogram, suffix: str) -> float:
    return sum(
        s.value for family in metric.collect() for s in family.samples if s.name.endswith(suffix)
    )


def _by_model(gauge: Gauge) -> dict[str, float]:
    return {s.labels["model"]: s.value for family in gauge.collect() for s in family.samples}


def _by_replica(counter: Counter) -> dict[str, float]:
    """`model@node` -> the counter's total."""
    return {
        f"{s.labels['model']}@{s.labels['node']}": s.value
        for family in counter.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


class Dashboard:
    def __init__(self) -> None:
        self.history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.errors: deque[dict] = deque(maxlen=ERRORS_KEPT)
        self._last: tuple[float, float, float, float, float] | None = (
            None  # time, tokens, requests, ttft sum, count
        )
        self._replicas: dict[str, float] = {}  # tokens by model@node at the last sample

    def sample(self, metrics, now: float | None = None) -> None:
        """One point of the gateway's series, from its metrics (called after each refresh)."""
        now = time.time() if now is None else now
        totals = (
            now,
            _total(metrics.generation_tokens, "_total"),
            _total(metrics.success, "_total"),
            _total(metrics.ttft, "_sum"),
            _total(metrics.ttft, "_count"),
        )
        replicas = _by_replica(metrics.generation_tokens)
        if self._last is not None and now > self._last[0]:
            dt, tokens, requests, ttft_sum, ttft_count = (a - b for a, b in zip(totals, self._last))
            self.history.append(
                {
                    "time_ms": int(now * 1000),
                    "tokens_per_s": round(tokens / dt, 1),
                    "requests_per_s": round(requests / dt, 2),
                    "ttft_s": round(ttft_sum / ttft_count, 3) if ttft_count else None,
                    "waiting": _by_model(metrics.waiting),
                    "running": _by_model(metrics.running),
                    "replica_tokens_per_s": {
                        r: round((n - self._replicas.get(r, 0)) / dt, 1)
                        for r, n in replicas.items()
                    },
                }
            )
        self._last, self._replicas = totals, replicas

    def error(
        self, status: int, code: str, method: str, path: str, request_id: str, key: str
    ) -> None:
        self.errors.appendleft(
            {
                "time_ms": int(time.time() * 1000),
                "status": status,
                "code": code,
                "route": f"{method} {path}",
                "request_id": request_id,
                "key": key,
            }
        )

    async def data(self, ctx) -> dict:
        fleet = await ctx.fleet.status()
        return {
            "fleet": fleet.model_dump(mode="json"),
            "history": list(self.history),
            "errors": list(self.errors),
        }
