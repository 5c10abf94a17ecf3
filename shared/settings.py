"""Settings, one class per service. Values come from the environment (`CORTEX_` prefix) and,
optionally, a TOML file named by `CORTEX_CONFIG` (`cortex … --config PATH`; the packages' units pass
/etc/cortex/cortex.toml): its top-level keys apply to every part, its `[gateway]`, `[node]` and
`[batch]` tables to one each (the batch worker reads `[gateway]` too, `[batch]` over it)."""

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)


class _TomlTables(TomlConfigSettingsSource):
    """Reads the file named by CORTEX_CONFIG: its top-level keys, then `tables` (each over the last)."""

    def __init__(self, settings_cls: type[BaseSettings], tables: tuple[str, ...]):
        path = os.environ.get("CORTEX_CONFIG")
        super().__init__(settings_cls, toml_file=Path(path) if path else None)
        found = {k: v for k, v in self.toml_data.items() if not isinstance(v, dict)}
        for table in tables:
            found |= self.toml_data.get(table, {})
        self.toml_data = found

    def __call__(self) -> dict[str, Any]:
        return self.toml_data


class CortexSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CORTEX_", extra="ignore")
    toml_tables: ClassVar[tuple[str, ...]] = ()

    redis_url: str = (
        "redis://127.0.0.1:6379/0"  # redis+cluster://host:port: a Redis Cluster (any of its nodes)
    )
    key_prefix: str = "cortex:"
    models_file: Path | None = None  # models.toml; the built-in catalogue when absent
    log_level: str = "INFO"
    # A streamed or background job's events are kept in Redis (`Keys.event_log`) this long after it
    # ends, for clients that resume; nodes keep the log alive while the job runs.
    stream_retention_s: int = Field(600, ge=1)
    otlp_endpoint: str = (
        ""  # an OTLP/HTTP collector (http://HOST:4318) for traces (shared/tracing.py); '': off
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _TomlTables(settings_cls, cls.toml_tables)

    @property
    def keys(self):
        from shared.keys import Keys
        from shared.redis_conn import is_cluster_url

        return Keys(self.key_prefix, cluster=is_cluster_url(self.redis_url))


class GatewaySettings(CortexSettings):
    toml_tables: ClassVar[tuple[str, ...]] = ("gateway",)

    host: str = "127.0.0.1"
    port: int = 31313
    node_ttl_s: float = 8.0  # a node whose heartbeat is older than this is dead
    request_timeout_s: float = 600.0  # longest a request may wait for its next event
    # jobs queued when Redis goes away, and new requests that find it away, wait this long for it to come
    # back; at most `redis_outage_max_waiting` new requests at once (gateway/bus/outage.py), then a 503
    redis_outage_wait_s: float = 30.0
    redis_outage_max_waiting: int = Field(1000, ge=0)
    max_request_bytes: int = (
        8 * 1024 * 1024
    )  # a request body over this is refused with 413 (not /v1/files)
    # /v1/files: files live in Redis (every replica sees them, they survive gateway restarts)
    files_max_bytes: int = 64 * 1024 * 1024  # an upload over this is refused with 413
    files_max_lines: int = 50_000  # a batch input file with more lines is refused with 413
    files_max_total_bytes: int = Field(
        1 << 30, gt=0
    )  # every file kept together; an upload past it is refused with 413
    # streaming clients that wait in the queue get `: queued position=N` comments this often
    queue_position_poll_s: float = 0.25
    queued_after_s: float = 0.1  # no first token within this long: look up the queue position
    # overload (docs/operations.md, "Fair shares and overload"): an interactive request still queued
    # after `queue_timeout_s` (the `x-cortex-queue-timeout` header may set its own, up to
    # `request_timeout_s`; 0: no deadline but that) is taken off the queue and answered 503
    # `queue_timeout`; one finding more than `queue_max_waiting` interactive jobs waiting for its
    # model (0: no limit) is refused at once with 503 `queue_full`; both with `Retry-After`
    queue_timeout_s: float = Field(120.0, ge=0)
    queue_max_waiting: int = Field(1000, ge=0)
    stream_maxlen: int = 100_000  # MAXLEN ~ for each per-model job stream
    eviction_strategy: Literal["lru", "priority"] = "lru"
    janitor_interval_s: float = 1.0  # how often one gateway checks for dead nodes and unplaced work
    scale_out_queue_depth: int = (
        4  # waiting jobs per replica that start another replica (up to max_replicas)
    )
    admin_key: str = ""  # bearer key for /admin/*; empty disables the admin API
    # /metrics without the admin key: once auth is on, series per API key are left out and those per node
    # and device summed over them (gateway/http/metrics_view.py); true refuses it to anyone but the admin key
    metrics_require_admin_key: bool = False
    # API keys (`cortex keys create`): clients must send one once any key exists or the gateway listens
    # beyond loopback; this forces that on a loopback gateway with no key yet too
    require_api_keys: bool = False
    # A streaming client that disconnects (without `background`) leaves its job running this long:
    # resuming within it keeps the job; after it, the job is cancelled (0: at once).
    disconnect_grace_s: float = Field(10.0, ge=0)
    # Cache-aware routing (gateway/fleet/routing.py): `cache` sends a job to the node where it costs least
    # (prompt tokens not cached there + `routing_load_weight` × tokens its running sequences hold) if
    # one holds part of it, else to where its session last ran, else to the least busy node;
    # `session` the last two; `none`: every job to the shared stream. A routed job waiting longer
    # than `affinity_wait_ms` on its node goes back to every node; a session is remembered `session_ttl_s`.
    routing: Literal["cache", "session", "none"] = "cache"
    routing_load_weight: float = Field(0.25, ge=0)
    affinity_wait_ms: int = Field(2000, ge=0)
    session_ttl_s: int = Field(3600, ge=1)
    # Who shares cached prompt prefixes (and so sees another's in `cached_tokens`): `key`, each API key
    # only its own (callers without one, anonymous or the admin key, share theirs); `fleet`, every key. Within
    # either, a request's `cache_salt` keeps its prompts apart from those without the same salt.
    prefix_cache_scope: Literal["key", "fleet"] = "key"
    responses_ttl_s: int = (
        30 * 24 * 3600
    )  # stored /v1/responses (previous_response_id) live this long, as OpenAI's
    # Image input (gateway/jobs/images.py): limits per image and per request; http(s) image URLs are refused
    # unless their host is listed here (then the gateway fetches them, bounded by the size limit and timeout)
    image_max_bytes: int = 5 * 1024 * 1024  # an encoded image over this is refused with 400
    image_max_pixels: int = 16_000_000  # width x height
    image_max_side: int = 8192  # pixels, either dimension
    images_per_request: int = 8
    image_url_hosts: list[
        str
    ] = []  # hosts whose http(s) image URLs the gateway may fetch; empty: none
    image_fetch_timeout_s: float = 10.0
    # the batch queue (arq, which needs one Redis, not a cluster): '' is `redis_url` itself, and must be
    # set when that names a Redis Cluster
    batch_redis_url: str = ""

    @property
    def batch_queue_url(self) -> str:
        """The batch queue's Redis; ValueError when that would be a cluster."""
        from shared.redis_conn import is_cluster_url

        if is_cluster_url(self.batch_redis_url or self.redis_url):
            raise ValueError(
                "CORTEX_REDIS_URL names a Redis Cluster, and the batch queue (arq) needs one Redis: "
                "set CORTEX_BATCH_REDIS_URL to a single Redis (redis://host:port/db)"
            )
        return self.batch_redis_url or self.redis_url


class NodeSettings(CortexSettings):
    toml_tables: ClassVar[tuple[str, ...]] = ("node",)

    node_name: str = ""  # default: hostname-pid
    models: list[str] = ["SmolLM2-135M-Instruct"]  # catalogue ids this node loads at start
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    memory_budget_mb: int = (
        0  # each CPU device reports this much memory (0: the host's); simulates a fleet
    )
    # Sleeping replicas (node_agent/serving/served_model.py `sleep`): a model idle past its keep_alive on
    # a CPU device keeps its engine in memory, up to this many MB for all of them (the least recently
    # used dropped first), and a load wakes it without reading or compiling anything. 0: off (idle
    # models are unloaded). A sleeping model's memory still counts against the device; placement
    # evicts sleeping models before idle ready ones, and wakes one before loading a model anywhere.
    sleep_mb: int = Field(0, ge=0)
    # Logical CPU devices ("cpu:0", "cpu:1", …), each its own device thread, for testing tensor
    # parallelism without GPUs and for CPU fleets; they share the host's cores and memory.
    cpu_devices: int = Field(1, ge=1, le=64)
    tp_timeout_s: float = Field(
        30.0, gt=0
    )  # a tensor-parallel collective waiting longer than this fails its model
    labels: list[str] = []  # affinity labels models can ask for
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 8.0
    # 0: on a CPU node its share of the host's cores, all of them when it is the only node agent
    # there (node_agent/host_share.py); on a GPU torch's default
    torch_threads: int = 0
    # A CPU node's torch threads bound one to a CPU each ("" off; "auto": the first CPUs it may run
    # on; or a list such as "0-15" or "0,2,4,6", as vLLM's VLLM_CPU_OMP_THREADS_BIND)
    cpu_bind: str = ""
    # How many nice levels (Linux) below the agent's own its device threads run: a step's CPU work
    # yields to the control plane (the node's intake and output process, a gateway or Redis on the
    # host) instead of making each of their wake-ups wait a scheduler slice. On a 2-core host with two
    # nodes, two gateways and Redis, a flood raised other clients' TTFT p50 2.3x at 0, 1.5x at 10
    # (docs/operations.md). 0: the agent's priority; an idle CPU is used whatever this is.
    device_nice: int = Field(10, ge=0, le=19)
    # How long a thread may hold the GIL while another waits (sys.setswitchinterval). The device
    # thread and the event loop share it: Python's 5 ms default lets one stall the other per step.
    gil_switch_interval_s: float = Field(0.0005, gt=0)
    hf_cache: str | None = (
        None  # Hugging Face cache dir; else HF_HUB_CACHE, HF_HOME/hub, the default
    )
    # Where `hf:` models this node pulls live (shared/model_store.py): from a peer node, else from the hub
    # (huggingface_hub: HF_ENDPOINT for a mirror, HF_TOKEN for gated or private repos)
    models_dir: Path = Path.home() / ".cache" / "cortex" / "models"
    # The most the models directory may hold; a pull evicts the least recently used files of models
    # not loaded, pinned or being pulled to fit, or fails naming what holds the disk. None: unbounded.
    models_disk_gb: float | None = Field(None, gt=0)
    # Peers: this node serves the files it holds, read-only, on `file_port` to nodes that send
    # `fleet_secret` (Authorization: Bearer); both must be set for it to serve, and the secret to fetch
    # from peers. `file_url` is the address other nodes use (default http://{hostname}:{file_port}).
    file_port: int = Field(0, ge=0, le=65535)
    file_host: str = "0.0.0.0"
    file_url: str = ""
    fleet_secret: str = ""
    # Dequantised copies of GGUF files (loads in ~1 s instead of ~15 s); empty disables it.
    convert_cache: Path | None = Path.home() / ".cache" / "cortex" / "converted"
    # Where a CPU node keeps Inductor's caches for the decode step it compiles at load
    # (node_agent/model/compiled_step.py: a minute or two the first time, ~15 s after); empty: decode
    # eagerly, as when another user owns the folder or its group or others may write to it.
    compile_cache: Path | None = Path.home() / ".cache" / "cortex" / "compiled"

    # The KV cache's disk tier (node_agent/engine/kv_disk.py): every full block a model computes is
    # kept here, content-addressed, and read back when a prompt's prefix continues there (across
    # restarts); each model keeps at most `kv_disk_gb`, least recently used evicted. Empty: off.
    kv_disk_dir: Path | None = None
    kv_disk_gb: float = Field(10.0, gt=0)

    @field_validator("convert_cache", "compile_cache", "kv_disk_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, value: Any) -> Any:
        return None if value in ("", None) else value

    min_free_mb: int = (
        256  # below this much free device memory, new jobs get 503 insufficient_memory
    )
    # The largest event a node publishes: a bigger one (an embedding job's vectors, prompt logprobs, a
    # long answer not streamed) waits in the job's `Keys.result` hash and its pointer is published
    # instead, so no pub/sub message comes near Redis's `client-output-buffer-limit pubsub`.
    # 64 KiB: Redis cuts a subscriber at 32 MB unread (`shared.processes.PUBSUB_BUFFER_LIMIT`), so
    # 512 of the largest events could wait unread on a gateway's connection before it did.
    max_event_bytes: int = Field(64 << 10, ge=4096)
    # A job whose client does not stream gets its tokens in one delta at most this often (and with
    # its end), not one event a token: its client sees only the whole answer (0: an event a step).
    whole_flush_s: float = Field(1.0, ge=0)
    # An embedding job's inputs × dimensions (floats returned) at most: more is refused with a 400.
    max_pooled_floats: int = Field(1 << 22, ge=1)
    shutdown_grace_s: float = 30.0  # on SIGTERM, running jobs get this long to finish
    # A replica `loading` or `poisoned` for longer than this is given up (`failed`), so that the fleet
    # places its model elsewhere (node_agent/serving/replica.py)
    replica_stuck_s: float = Field(900.0, gt=0)
    # A replica that failed (to load, or was given up) stays `failed` in the heartbeat this long, so
    # that placement puts its model on other nodes meanwhile; then it is forgotten and may be tried again
    failed_backoff_s: float = Field(300.0, ge=0)
    # priority classes (shared/queues.py): batch lines fill idle slots but leave this many free
    # for interactive arrivals, and a batch line that waited this long goes ahead of interactive work
    interactive_reserved_slots: int = 1
    batch_max_wait_s: float = 60.0
    # fair shares (shared/queues.py): while callers' jobs wait in waiting rooms, a replica takes up to
    # this many jobs beyond its slots, each of a caller with no job running on it, and its engine
    # preempts a sequence of the caller holding the most rows for each: one caller's flood does not
    # make another's first job wait for a slot (0: newcomers wait for a slot like everyone)
    newcomer_slots: int = Field(1, ge=0)


class BatchSettings(GatewaySettings):
    """`cortex batch-worker`: the arq worker that runs `/v1/batches` (tables `[gateway]`, then `[batch]`)."""

    toml_tables: ClassVar[tuple[str, ...]] = ("gateway", "batch")

    batch_lines_in_flight: int = 64  # per batch: lines queued or running on the job streams at once
    batch_max_tries: int = (
        3  # tries of a line whose node died (waiting for Redis to come back costs none)
    )
    batch_lease_s: float = 15.0  # a dead worker's batches are resumed by another this long after
    batch_resume_every_s: int = 5  # how often each worker looks for batches nobody runs (1-60)
    batch_max_concurrent: int = 16  # batches one worker runs at once
    arq_poll_delay_s: float = 0.5  # arq's poll of its queue (only the start of a batch waits on it)
