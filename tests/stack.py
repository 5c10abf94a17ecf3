"""A whole Cortex on this machine for end-to-end tests: its own redis-server, a gateway under
uvicorn and node agents, each a real process on a free loopback port."""

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.processes import free_port, redis_answers, redis_server_argv
from tests.conftest import Service, _http_ok, wait_until
from tests.redis_cluster import LocalCluster, start_cluster

NODE_START_TIMEOUT_S = 180.0  # a first GGUF load dequantises for ~30 s on a busy 2-core machine
DOCUMENTED_KEYS = re.compile(
    r"^cortex:(jobs:.+|nodes|node:.+|fleet:changes|catalog|cmd:.+|pins|lock:placement:.+|modelfiles:.+|host:.+|lock:pull:.+|lock:janitor|file:.+|files|files:bytes|batch:[^:]+|batches"
    r"|batches:active|response:.+|responses:background|eventlog:.+|result:.+|detached:.+|metered:.+|started:.+|arq:queue|arq:queue:health-check|apikeys|apikey:.+|ratelimit:.+:(requests|tokens)|usage:.+:\d{4}-\d\d-\d\d|prefixes:.+|session:.+|routing:.+)$"
    r"|^arq:(cron|job|in-progress|result|retry):.+$"
)


@dataclass
class Stack:
    root: Path
    redis_url: str
    gateway_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    keys: Keys = Keys()
    cluster: LocalCluster | None = None  # the Redis Cluster it runs on (`start_cluster_stack`)

    def client(self) -> redis.Redis:
        if self.cluster is not None:
            return self.cluster.client(decode_responses=False)
        return redis.Redis.from_url(self.redis_url)

    def start_gateway(self, port: int | None = None) -> None:
        """A gateway replica on `port` (None: a free one; a port: where a killed replica listened)."""
        port = port or free_port()
        env = self.env | {"CORTEX_HOST": "127.0.0.1", "CORTEX_PORT": str(port)}
        log_name = (
            "gateway.log" if not self.gateway_url else f"gateway-{port}.log"
        )  # a second replica's own log
        gateway = Service(
            "gateway", [sys.executable, "-m", "gateway"], self.root / log_name, env=env
        )
        self.services.append(gateway)
        self.gateway_url = f"http://127.0.0.1:{port}"
        gateway.wait_ready(lambda: _http_ok(f"{self.gateway_url}/health"))

    def start_gateways(self, count: int) -> None:
        """`count` gateway replicas on one Redis; their URLs in `replicas` (the last is `gateway_url`)."""
        self.replicas = []
        for _ in range(count):
            self.start_gateway()
            self.replicas.append(self.gateway_url)

    def start_node(self, name: str, models: list[str] | None = None, **env: str) -> Service:
        """A node loading `models` at start (None: its default; []: none, it waits for placement)."""
        node_env = self.env | {"CORTEX_NODE_NAME": name} | env
        if models is not None:
            node_env["CORTEX_MODELS"] = "[" + ",".join(f'"{m}"' for m in models) + "]"
        node = Service(
            f"node {name}",
            [sys.executable, "-m", "node_agent"],
            self.root / f"node-{name}.log",
            env=node_env,
        )
        self.services.append(node)
        client = self.client()

        def ready() -> bool:
            loaded = client.hget(self.keys.node(name), "models")
            return loaded is not None and (models == [] or b'"ready"' in loaded)

        node.wait_ready(ready, NODE_START_TIMEOUT_S)
        return node

    def models_on(self, node: str) -> dict[str, dict]:
        """What `node`'s heartbeat says it holds: model -> info."""
        return json.loads(self.client().hget(self.keys.node(node), "models") or b"{}")

    def jobs_held_by(self, node: str) -> int:
        """Entries of any job stream that Redis holds as delivered to `node` and not yet
        acknowledged: the jobs it runs now, read from the consumer groups themselves (a heartbeat's
        `slots_used` is a sample every 2 s, which short jobs fall between)."""
        client = self.client()
        return sum(
            int(c["pending"])
            for s in client.keys("cortex:jobs:*")
            for c in client.xpending(s, CONSUMER_GROUP)["consumers"]
            if c["name"] in (node, node.encode())
        )

    def start_batch_worker(self, **env: str) -> Service:
        """`python -m gateway.batch`; ready once arq has run its start-up (it logs "Starting worker")."""
        worker = Service(
            "batch worker",
            [sys.executable, "-m", "gateway.batch"],
            self.root / f"batch-worker-{len(self.services)}.log",
            env=self.env | env,
        )
        self.services.append(worker)
        worker.wait_ready(lambda: "batch worker" in worker.log_path.read_text(errors="replace"))
        return worker

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def assert_clean(self, timeout_s: float = 5.0) -> None:
        """No pending entries, no queued jobs (on a stream or in a waiting room), and no keys beyond
        the documented ones."""
        client = self.client()

        def clean() -> bool:
            streams = [k.decode() for k in client.keys("cortex:jobs:*")]
            busy = any(
                client.xlen(s) or client.xpending(s, CONSUMER_GROUP)["pending"] for s in streams
            )
            return not busy and not client.keys("cortex:waiting:*")  # no job in a waiting room

        try:
            wait_until(clean, timeout_s, "jobs to be acknowledged")
        finally:
            stray = [
                k.decode()
                for k in client.keys("*")
                if not DOCUMENTED_KEYS.match(untagged(k.decode()))
            ]
            assert stray == [], f"keys left behind: {stray}"


def untagged(key: str) -> str:
    """A cluster's key as one Redis names it (`Keys` without hash tags): ``cortex:{fleet}:nodes`` is
    ``cortex:nodes``, ``cortex:jobs:{m}:batch`` is ``cortex:jobs:m:batch``."""
    return re.sub(
        r"\{([^}]*)\}",
        r"\1",
        re.sub(r"^cortex:\{(fleet|responses|files|batches|apikeys)\}:", "cortex:", key),
    )


def start_cluster_stack(root: Path, models_toml: str | None = None, **env: str) -> Stack:
    """A stack on a local Redis Cluster (3 masters, 3 replicas), with a single redis-server for the
    batch queue (arq needs one Redis)."""
    cluster = start_cluster(root / "cluster")
    try:
        stack = start_stack(root, models_toml, **env)  # its redis-server is the batch queue's
    except BaseException:
        cluster.stop()
        raise
    stack.env |= {"CORTEX_REDIS_URL": cluster.url, "CORTEX_BATCH_REDIS_URL": stack.redis_url}
    stack.redis_url, stack.cluster, stack.keys = cluster.url, cluster, Keys(cluster=True)
    return stack


def start_stack(
    root: Path, models_toml: str | None = None, durable: bool = False, **env: str
) -> Stack:
    """A stack of one redis-server (`durable`: with its append-only file, as `cortex up` runs it)."""
    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    server = Service(
        "redis-server", redis_server_argv(port, workdir=root, durable=durable), root / "redis.log"
    )
    server.wait_ready(lambda: redis_answers(redis_url))
    # one torch thread a node: a test's nodes share this machine's cores with each other and the suite
    stack_env = (
        os.environ
        | {"CORTEX_REDIS_URL": redis_url, "CORTEX_LOG_LEVEL": "INFO", "CORTEX_TORCH_THREADS": "1"}
        | env
    )
    if models_toml is not None:
        (root / "models.toml").write_text(models_toml)
        stack_env["CORTEX_MODELS_FILE"] = str(root / "models.toml")
    stack = Stack(root=root, redis_url=redis_url, env=stack_env, services=[server])
    return stack


@contextmanager
def serving(
    root: Path, models_toml: str | None, node: str, models: list[str] | None = None, **env: str
) -> Iterator[Stack]:
    """A stack with one gateway and one node agent loading `models` (see `Stack.start_node`),
    stopped on the way out."""
    stack = start_stack(root, models_toml, **env)
    try:
        stack.start_gateway()
        stack.start_node(node, models)
        yield stack
    finally:
        stack.stop()


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    wait_until(predicate, timeout_s, what)


def checked(session_fixture: str, name: str = "stack", timeout_s: float = 10.0):
    """A fixture `name` over the session's `session_fixture` stack, checked after each test for
    pending entries, subscriptions and stray keys (`Stack.assert_clean`)."""

    @pytest.fixture(name=name)
    def stack(request) -> Iterator[Stack]:
        shared = request.getfixturevalue(session_fixture)
        yield shared
        shared.assert_clean(timeout_s=timeout_s)

    return stack


def beat(client: redis.Redis, node: str = "n1", model: str | None = None) -> None:
    """A heartbeat as a node's, saying `model` (the default model) is ready on `node`."""
    from shared.catalog import DEFAULT_MODEL_ID
    from shared.heartbeat import ModelInfo, NodeHeartbeat

    now_ms = int(time.time() * 1000)
    heartbeat = NodeHeartbeat(
        node=node,
        version="test",
        started_ms=now_ms,
        heartbeat_ms=now_ms,
        models={model or DEFAULT_MODEL_ID: ModelInfo(state="ready", device="cpu")},
    )
    client.hset(Keys().node(node), mapping=heartbeat.to_hash())
    client.zadd(Keys().nodes(), {node: now_ms})
