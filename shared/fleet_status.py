"""What `cortex status` shows (and prints with `--json`): pydantic views of the fleet, built by
`shared.fleet.Fleet.status`."""

import json

from pydantic import BaseModel

from shared.heartbeat import KVCacheStats, NodeHeartbeat, PullProgress, SpecDecodeStats
from shared.redis_health import RedisHealth


class DeviceStatus(BaseModel):
    id: str
    name: str
    total_mb: int
    free_mb: int
    used_mb: int


class ModelStatus(BaseModel):
    state: str
    device: str
    devices: list[
        str
    ] = []  # every device it holds: one replica spanning several when tensor-parallel
    slots_used: int
    slots_total: int
    memory_mb: int = 0
    max_model_len: int = 0  # the context it runs with; 0 until loaded
    quant: str = (
        ""  # how its Linear weights are held ("int4", "int8", "fp8", "none"); "" until loaded
    )
    weight_mb: int = 0  # what its weights hold on its device; 0 until loaded
    kernels: str = ""  # which kernels its matmuls and decode step run, in words; "" until loaded
    last_used_ms: int = 0  # when a job last ended (or the model became ready); 0: unknown
    idle_s: float | None = None  # seconds since last_used_ms; None when unknown
    queue_depth: int = 0  # jobs no node has read yet, over all of the model's streams (fleet-wide)
    kv: KVCacheStats | None = None  # its KV cache and prefix cache; None until its engine is built
    spec: SpecDecodeStats | None = (
        None  # its speculative decoding's counters; None until its engine is built
    )
    error: str = ""
    download: PullProgress | None = None  # its files on their way, while `downloading`


class NodeStatus(BaseModel):
    node: str
    alive: bool
    heartbeat_ms: int  # from the hash when present, else the `cortex:nodes` score
    heartbeat_age_s: float
    version: str = ""
    state: str = "gone"  # active | draining | drained | gone (no heartbeat hash: expired or shut down) | unreadable
    labels: list[str] = []
    started_ms: int = 0
    devices: list[DeviceStatus] = []
    models: dict[str, ModelStatus] = {}
    error: str = ""  # the hash could not be read

    @classmethod
    def of(
        cls,
        node: str,
        score_ms: int,
        hb: NodeHeartbeat | ValueError | None,
        *,
        node_ttl_s: float,
        now_ms: int,
    ) -> "NodeStatus":
        """One node's row: from its heartbeat hash if it still exists, else a `gone` row from its score."""
        if not isinstance(hb, NodeHeartbeat):
            return cls(
                node=node,
                alive=False,
                heartbeat_ms=score_ms,
                heartbeat_age_s=(now_ms - score_ms) / 1000,
                **({"state": "unreadable", "error": str(hb)} if hb is not None else {}),
            )
        age_s = (now_ms - hb.heartbeat_ms) / 1000
        return cls(
            node=node,
            alive=age_s <= node_ttl_s,
            heartbeat_ms=hb.heartbeat_ms,
            heartbeat_age_s=age_s,
            version=hb.version,
            state=str(hb.state),
            labels=hb.labels,
            started_ms=hb.started_ms,
            devices=[
                DeviceStatus(**d.model_dump(), used_mb=d.total_mb - d.free_mb) for d in hb.devices
            ],
            models={
                name: ModelStatus(
                    state=str(m.state),
                    device=m.device,
                    devices=m.devices or [m.device],
                    slots_used=m.slots_used,
                    slots_total=m.slots_total,
                    memory_mb=m.memory_mb,
                    max_model_len=m.max_model_len,
                    quant=m.quant,
                    weight_mb=m.weight_mb,
                    kernels=m.kernels,
                    last_used_ms=m.last_used_ms,
                    idle_s=max(0.0, (now_ms - m.last_used_ms) / 1000) if m.last_used_ms else None,
                    kv=m.kv,
                    spec=m.spec,
                    error=m.error,
                    download=m.download,
                )
                for name, m in hb.models.items()
            },
        )


# How a gateway routed a job (gateway/fleet/routing.py), as `Keys.routing` counts them: to the node whose
# cache holds its prefix, the node of its session's last turn, the least busy node (a new
# conversation), another node than those (they had no room, or cost more), the shared stream; `moved`:
# the janitor moved it from a node's own stream to every node's.
ROUTING_OUTCOMES = ("cache", "session", "load", "full", "shared", "moved")


class QueueStatus(BaseModel):
    """One model's queues over every priority class and band (shared/queues.py)."""

    model: str
    queued: dict[str, int]  # class -> jobs no node has read yet
    running: int  # jobs read by a node, not yet finished, all classes
    replicas: int  # live replicas taking jobs
    oldest_wait_s: float | None  # the longest any queued job has waited
    oldest_wait_s_by_class: dict[str, float | None]
    routed: dict[
        str, int
    ] = {}  # jobs by how the gateways routed them (`Keys.routing`), by ROUTING_OUTCOMES
    prefix_hit_rate: float | None = (
        None  # prompt tokens found cached over those looked up, all its replicas together
    )


class CatalogModelStatus(BaseModel):
    """A catalogue model (`cortex:catalog`) that no live node holds."""

    model: str
    state: str = "not loaded"
    memory_mb: int | None = None
    pin: bool = False
    queue_depth: int = 0

    @classmethod
    def of(cls, model: str, raw_profile: bytes, queue_depth: int) -> "CatalogModelStatus":
        try:
            profile = json.loads(raw_profile)
        except (ValueError, TypeError):
            profile = {}
        return cls(
            model=model,
            memory_mb=profile.get("memory_mb"),
            pin=bool(profile.get("pin", False)),
            queue_depth=queue_depth,
        )


class FleetStatus(BaseModel):
    now_ms: int
    nodes: list[NodeStatus]
    queues: list[QueueStatus]
    not_loaded: list[CatalogModelStatus] = []
    redis: RedisHealth | None = None  # how Redis keeps its data and how full it is (None: not read)
