"""A real Redis Cluster on loopback for tests and benchmarks: `masters * (1 + replicas)` private
redis-server processes (no persistence, each in its own directory with its own nodes.conf), joined by
`redis-cli --cluster create`, with helpers to find a key's master, kill a node and wait for failover.

    with running_cluster(tmp_path) as cluster:
        cluster.client().set("k", "v")

Each node gets two free ports: its client port and its cluster-bus port (`--cluster-port`; the
default, port + 10000, overflows for ephemeral ports). `--cluster-node-timeout 1000` makes a killed
master fail over in a few seconds."""

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from shared.processes import free_port, redis_answers, redis_server_argv
from tests.conftest import Service

HOST = "127.0.0.1"
SLOTS = 16384
READY_TIMEOUT_S = 30.0


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def _wait(condition: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    """Until `condition()` holds (a RedisError counts as not yet); TimeoutError with `what()` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"after {timeout_s:g}s: {what()}")


class LocalCluster:
    """The redis-server processes of one cluster, by client port (see `start_cluster`)."""

    def __init__(self, root: Path):
        self.root = root
        self.nodes: dict[int, Service] = {}
        self.argv: dict[int, list[str]] = {}  # how each node was started (a restart uses it again)
        self.ports: list[int] = []  # every node's client port, the masters at creation first
        self.create_output = ""  # what `redis-cli --cluster create` printed

    @property
    def url(self) -> str:
        """Every node as a seed, as an operator names a cluster: a client started while one is down still finds it."""
        return "redis+cluster://" + ",".join(f"{HOST}:{port}" for port in self.ports)

    @property
    def seed_urls(self) -> list[str]:
        return [f"redis://{HOST}:{port}" for port in self.ports]

    def live_ports(self) -> list[int]:
        return [port for port in self.ports if self.nodes[port].alive()]

    def node(self, port: int) -> redis.Redis:
        """A plain client to one node (the caller closes it)."""
        return redis.Redis(host=HOST, port=port, decode_responses=True, socket_timeout=2.0)

    def _ask(self, command: Callable[[redis.Redis], object], port: int | None = None):
        """`command` on `port`, or on the first live node that answers."""
        for candidate in [port] if port is not None else self.live_ports():
            client = self.node(candidate)
            try:
                return command(client)
            except (redis.ConnectionError, redis.TimeoutError):
                if port is not None:
                    raise
            finally:
                client.close()
        raise redis.ConnectionError("no live node answers")

    def _slot_owners(self, port: int | None = None) -> list[tuple[int, int, int]]:
        """(first slot, last slot, master's port) as one node sees them (CLUSTER SLOTS)."""
        ranges = self._ask(lambda c: c.execute_command("CLUSTER SLOTS"), port)
        return [(int(r[0]), int(r[1]), int(r[2][1])) for r in ranges]

    def master_port_of(self, key: str) -> int:
        """The port of the master that owns `key`'s slot now."""
        slot = int(self._ask(lambda c: c.execute_command("CLUSTER KEYSLOT", key)))
        return next(owner for first, last, owner in self._slot_owners() if first <= slot <= last)

    def masters(self) -> list[int]:
        """Ports of the masters not flagged failed, as a live node sees them."""
        nodes = self._ask(lambda c: c.execute_command("CLUSTER NODES"))
        return sorted(
            int(addr.rsplit(":", 1)[1])
            for addr, node in nodes.items()
            if "master" in node["flags"] and "fail" not in node["flags"]
        )

    def replicas(self) -> list[int]:
        """Live nodes whose role is replica."""
        return [
            port
            for port in self.live_ports()
            if self._ask(lambda c: c.info("replication")["role"], port) == "slave"
        ]

    def masters_with_replicas(self) -> list[int]:
        """Ports of the live masters that a live replica follows (those that can fail over)."""
        nodes = self._ask(lambda c: c.execute_command("CLUSTER NODES"))
        followed = {
            node["master_id"]
            for node in nodes.values()
            if "slave" in node["flags"] and "fail" not in node["flags"]
        }
        return sorted(
            int(addr.rsplit(":", 1)[1])
            for addr, node in nodes.items()
            if "master" in node["flags"]
            and "fail" not in node["flags"]
            and node["node_id"] in followed
        )

    def client(self, decode_responses: bool = True) -> RedisCluster:
        """A cluster client seeded with a live master."""
        live = set(self.live_ports())
        seed = next(port for port in self.masters() if port in live)
        return RedisCluster(host=HOST, port=seed, decode_responses=decode_responses)

    def commands_per_node(self) -> dict[int, int]:
        """Per live node: total calls in INFO commandstats (every command it has served)."""
        return {
            port: sum(
                stat["calls"] for stat in self._ask(lambda c: c.info("commandstats"), port).values()
            )
            for port in self.live_ports()
        }

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` and reap it."""
        service = self.nodes[port]
        service.proc.kill()
        service.proc.wait()
        service.stop()

    def wait_replicated(self, port: int, timeout_s: float = 10.0) -> None:
        """Until every replica of the master on `port` has acknowledged all it has written so far
        (WAIT would only count the writes of its own connection)."""
        with self.node(port) as master:
            info = master.info("replication")
            target = int(info["master_repl_offset"])
            _wait(
                lambda: (
                    all(
                        int(r["offset"]) >= target
                        for k, r in master.info("replication").items()
                        if k.startswith("slave") and isinstance(r, dict)
                    )
                    and info["connected_slaves"] > 0
                ),
                timeout_s,
                lambda: f"the replicas of {port} did not reach offset {target}",
            )

    def rejoin(self, port: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start a killed node again on its files: it rejoins as a replica of the master that took its
        slots (what an operator does after a failover); returns once its replication link is up."""
        workdir = self.root / f"node-{port}"
        self.nodes[port] = Service(f"redis-{port}", self.argv[port], workdir / "redis-rejoined.log")
        _wait(
            lambda: (
                self._ask(lambda c: c.info("replication").get("master_link_status"), port) == "up"
            ),
            timeout_s,
            lambda: f"{port} did not rejoin as a replica; cluster nodes:\n{self._describe()}",
        )

    def healthy(self, without: int | None = None) -> bool:
        """Every live node: cluster_state ok, all slots ok, and (with `without`) no slot owned by it."""
        for port in self.live_ports():
            info = self._ask(lambda c: c.cluster("info"), port)
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return False
            if without is not None and any(
                owner == without for _, _, owner in self._slot_owners(port)
            ):
                return False
        return True

    def wait_for_failover(self, dead_port: int, timeout_s: float = 30.0) -> float:
        """Until every live node sees all slots served by masters other than `dead_port` and says
        cluster_state:ok; returns the seconds it took."""
        started = time.monotonic()
        _wait(
            lambda: self.healthy(without=dead_port),
            timeout_s,
            lambda: f"no failover from {dead_port}; cluster nodes:\n{self._describe()}",
        )
        return time.monotonic() - started

    def wait_ready(self, masters: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every node knows every other, the cluster is ok everywhere and every replica's link is up."""
        total = len(self.ports)

        def ready() -> bool:
            for port in self.ports:
                info = self._ask(lambda c: c.cluster("info"), port)
                if int(info.get("cluster_known_nodes", 0)) != total:
                    return False
            if not self.healthy() or len(self.masters()) != masters:
                return False
            return (
                all(
                    self._ask(lambda c: c.info("replication").get("master_link_status"), port)
                    == "up"
                    for port in self.replicas()
                )
                and len(self.replicas()) == total - masters
            )

        _wait(
            ready,
            timeout_s,
            lambda: (
                f"cluster not ready; redis-cli said:\n{self.create_output}\n"
                f"cluster nodes:\n{self._describe()}"
            ),
        )

    def _describe(self) -> str:
        def raw_nodes(client: redis.Redis) -> str:
            client.set_response_callback("CLUSTER NODES", lambda response, **options: response)
            return client.execute_command("CLUSTER NODES")

        try:
            return self._ask(raw_nodes)
        except redis.RedisError as exc:
            return f"(unavailable: {exc})"

    def stop(self) -> None:
        for service in self.nodes.values():
            service.stop()


def start_cluster(root: Path, masters: int = 3, replicas: int = 1) -> LocalCluster:
    """Start `masters * (1 + replicas)` nodes under `root`, create the cluster and wait until it is
    ready (every slot covered, every replica in sync); RuntimeError/TimeoutError otherwise."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise FileNotFoundError("redis-cli is not on PATH")
    cluster = LocalCluster(root)
    try:
        ports = _free_ports(2 * masters * (1 + replicas))
        for port, bus_port in zip(ports[0::2], ports[1::2]):
            workdir = root / f"node-{port}"
            workdir.mkdir(parents=True)
            argv = redis_server_argv(port, workdir=workdir) + [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                str(bus_port),
                "--repl-diskless-sync-delay",
                "0",
            ]  # a replica's first sync at once, not after 5 s
            cluster.argv[port] = argv
            cluster.nodes[port] = Service(f"redis-{port}", argv, workdir / "redis.log")
            cluster.ports.append(port)
        for port, service in cluster.nodes.items():
            service.wait_ready(lambda url=f"redis://{HOST}:{port}": redis_answers(url))
        create = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"{HOST}:{port}" for port in cluster.ports),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT_S,
        )
        cluster.create_output = re.sub(
            r"\x1b\[[0-9;]*m", "", create.stdout + create.stderr
        )  # no colours
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({create.returncode}):\n{cluster.create_output}"
            )
        cluster.wait_ready(masters)
        first = cluster.masters()
        cluster.ports.sort(key=lambda port: port not in first)  # masters first, in creation order
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def running_cluster(root: Path, masters: int = 3, replicas: int = 1) -> Iterator[LocalCluster]:
    """A started cluster (see `start_cluster`), stopped on exit."""
    cluster = start_cluster(root, masters, replicas)
    try:
        yield cluster
    finally:
        cluster.stop()
