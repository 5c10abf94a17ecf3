"""A node's heartbeat: what `HGETALL cortex:node:{node}` shows.

Scalar fields are plain strings; `devices` and `models` are JSON so they read well in redis-cli.
"""

import json

from pydantic import BaseModel

from shared.lifecycle import ModelState, NodeState


class DeviceInfo(BaseModel):
    id: str  # "cpu" or "cuda:0"
    name: str
    total_mb: int
    free_mb: int


class KVCacheStats(BaseModel):
    """A replica's paged KV cache and prefix cache; the counters count from the engine's start."""

    block_size: int = 0  # tokens per block
    blocks_total: int = 0  # blocks in the pool
    blocks_used: int = 0  # held by running sequences
    blocks_cached: int = 0  # free, but holding a reusable prefix (evicted LRU when needed)
    prefix_queries: int = 0  # counter: prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # counter: of those, tokens found cached
    preemptions: int = 0  # counter: sequences preempted (recomputed later) for lack of blocks
    # The tiers below the device (node_agent/engine/kv_tiers.py; 0 where off). prefix_hits counts
    # every tier's: the device's are prefix_hits - host_hits - disk_hits.
    host_blocks_total: int = 0  # host-memory slots (`kv_host_mb`)
    host_blocks_used: int = 0  # of those, holding a block
    disk_blocks: int = 0  # blocks kept on disk (`kv_disk_dir`)
    host_hits: int = 0  # counter: prompt tokens restored from host memory
    disk_hits: int = 0  # counter: prompt tokens read back from disk
    offloaded_bytes: int = 0  # counter: bytes copied device -> host
    restored_bytes: int = 0  # counter: bytes copied host -> device
    disk_written_bytes: int = 0  # counter
    disk_read_bytes: int = 0  # counter

    @property
    def usage(self) -> float:
        """The share of the pool held by running sequences, 0..1 (cached blocks are free)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


class PullProgress(BaseModel):
    """A model's files on their way to a node (node_agent/weights/puller.py)."""

    source: str = ""  # "hub" or "peer NODE"; "" while the source is being chosen
    bytes_done: int = 0
    bytes_total: int = 0  # 0 until the source said how much
    rate_bps: float = 0.0  # bytes per second over the last few seconds
    error: str = ""  # why it failed (a failed pull stays listed `failed_backoff_s`, or until the next one starts)

    @property
    def fraction(self) -> float:
        return min(self.bytes_done / self.bytes_total, 1.0) if self.bytes_total else 0.0


class SpecDecodeStats(BaseModel):
    """A replica's speculative decoding (vLLM's spec_decode counters), counting from the engine's start."""

    drafts: int = 0  # counter: steps of a sequence that checked draft tokens
    draft_tokens: int = 0  # counter: draft tokens checked
    accepted_tokens: int = 0  # counter: of those, accepted


class ModelInfo(BaseModel):
    state: ModelState
    device: str  # the device it runs on (rank 0's, when tensor-parallel)
    devices: list[str] = []  # every device it holds (several when tensor-parallel); empty: [device]
    slots_total: int = 0
    slots_used: int = 0
    memory_mb: int = 0  # what this replica holds on its device (weights + KV cache)
    max_model_len: int = 0  # the longest sequence it runs (the catalogue's, capped by the model's own); 0 until loaded
    quant: str = ""  # how its Linear weights run: "int4", "int8", "fp8", "int4+int8", "none"; "" until loaded
    weight_mb: int = 0  # what its weights hold on its device; 0 until loaded
    kernels: str = ""  # which kernels its matmuls and decode step run, in words; "" until loaded
    last_used_ms: int = 0  # when a job last ended (or the model became ready)
    keep_until_ms: int = 0  # a request's keep_alive (Ollama's) holds it loaded at least until then
    error: str = ""  # why it is poisoned or failed
    kv: KVCacheStats | None = None  # None: the engine is not built yet
    spec: SpecDecodeStats | None = None  # None: the engine is not built yet
    download: PullProgress | None = None  # while `downloading`


class NodeHeartbeat(BaseModel):
    node: str
    version: str
    state: NodeState = NodeState.ACTIVE
    labels: list[str] = []
    started_ms: int
    heartbeat_ms: int
    seq: int = 0  # heartbeats that changed something, since the node started (shared/fleet_view.py)
    devices: list[DeviceInfo] = []
    models: dict[str, ModelInfo] = {}
    file_url: str = ""  # where peers fetch the model files it holds ('': it serves none)
    # The process beating: its host's name (peers send the fleet secret only to a file_url there;
    # node agents on one host share its cores), its pid, and an id drawn at its start (a second
    # process under a live node's name is refused: node_agent/serving/node_identity.py)
    host: str = ""
    pid: int = 0
    instance: str = ""
    pulls: dict[
        str, PullProgress
    ] = {}  # model folder -> progress, for every pull in progress (loads and `pull`s)

    def to_hash(self) -> dict[str, str]:
        return {
            "node": self.node,
            "version": self.version,
            "state": str(self.state),
            "started_ms": str(self.started_ms),
            "heartbeat_ms": str(self.heartbeat_ms),
            "seq": str(self.seq),
            "labels": json.dumps(self.labels),
            "devices": json.dumps([d.model_dump() for d in self.devices]),
            "models": json.dumps({k: m.model_dump(mode="json") for k, m in self.models.items()}),
            "file_url": self.file_url,
            "host": self.host,
            "pid": str(self.pid),
            "instance": self.instance,
            "pulls": json.dumps({k: p.model_dump() for k, p in self.pulls.items()}),
        }

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> "NodeHeartbeat":
        data = {k.decode(): v.decode() for k, v in fields.items()}
        data["labels"] = json.loads(data.get("labels", "[]"))
        data["devices"] = json.loads(data.get("devices", "[]"))
        data["models"] = json.loads(data.get("models", "{}"))
        data["pulls"] = json.loads(data.get("pulls", "{}"))
        return cls.model_validate(data)

    @classmethod
    def empty(cls, node: str) -> "NodeHeartbeat":
        return cls(node=node, version="", started_ms=0, heartbeat_ms=0)

    @property
    def takes_jobs(self) -> bool:
        return self.state.takes_jobs

    def serves(self, model: str) -> bool:
        """Ready, downloading, loading, or poisoned: a poisoned model reloads itself, and jobs for it
        wait for that (rather than being placed elsewhere, or failed as if nobody could run it); a
        replica downloading its files is one coming, as one loading is."""
        info = self.models.get(model)
        return info is not None and info.state in (
            ModelState.READY,
            ModelState.DOWNLOADING,
            ModelState.LOADING,
            ModelState.POISONED,
        )
