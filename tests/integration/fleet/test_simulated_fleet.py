"""Simulated nodes (node_agent/sim: the real node agent over a synthetic engine) in a real fleet: a
real node and simulated ones serve one model behind one gateway, and conversations are routed
between them by what their caches hold; and the control plane's cost per request stays flat from 5
to 100 simulated nodes (issue 48), counted from the Redis commands the gateways send (MONITOR)."""

import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest
import redis

from tests.conftest import Service
from tests.integration.fleet.conftest import catalogue
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.integration
MODEL = "tiny-a"


def simulate(stack: Stack, count: int, preload: list[str], first: int = 0, **flags) -> Service:
    """`python -m node_agent --simulate count` on the stack's Redis; ready once every node it runs
    sends heartbeats and what it preloads is ready."""
    argv = [sys.executable, "-m", "node_agent", "--simulate", str(count), "--first", str(first)]
    argv += ["--preload", ",".join(preload)]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    sim = Service(
        f"sim-{first}",
        argv,
        stack.root / f"sim-{first}.log",
        env=stack.env | {"CORTEX_LOG_LEVEL": "WARNING"},
    )
    stack.services.append(sim)
    client = stack.client()
    names = [f"sim-{n}" for n in range(first, first + count)]

    fleet = flags.get("fleet_size", first + count)
    expected = sum(1 for j in range(len(preload)) if first <= j % fleet < first + count)

    def ready() -> bool:
        with client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(stack.keys.node(name), "models")
            held = pipe.execute()
        return None not in held and sum(h.count(b'"ready"') for h in held) >= expected

    sim.wait_ready(ready, 120)
    return sim


def _chat(base_url: str, system: str, user: str, model: str = MODEL, max_tokens: int = 4):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens,
        temperature=0,
    )


# ---- a real node and simulated nodes in one fleet -------------------------------------------------


def test_a_real_node_and_simulated_nodes_share_a_model_and_routing(tmp_path, tiny_dirs):
    toml = catalogue(tiny_dirs["llama"], **{MODEL: {"slots": 4, "max_model_len": 256}})
    stack = start_stack(
        tmp_path,
        toml,
        CORTEX_HEARTBEAT_S="0.3",
        CORTEX_HEARTBEAT_TTL_S="3",
        CORTEX_NODE_TTL_S="3",
        CORTEX_JANITOR_INTERVAL_S="0.2",
    )
    try:
        stack.start_gateway()
        stack.start_node("n1", models=[MODEL], CORTEX_MEMORY_BUDGET_MB="500")
        simulate(stack, 2, [MODEL, MODEL], step_ms=5)
        nodes = ["n1", "sim-0", "sim-1"]
        systems = [f"Conversation {i}. " + "Say little about many things. " * 3 for i in range(6)]
        with ThreadPoolExecutor(len(systems)) as pool:  # at once: the least busy node takes each
            first = list(pool.map(lambda s: _chat(stack.gateway_url, s, "Hello"), systems))
        r = stack.client()
        holding = {n: r.hlen(stack.keys.prefixes(MODEL, n)) for n in nodes}
        assert all(holding.values()), f"each node took conversations: {holding}"
        second = [_chat(stack.gateway_url, s, "And then?") for s in systems]
        cached = [c.usage.prompt_tokens_details.cached_tokens for c in second]
        assert all(cached), f"every next turn went where its prefix is cached: {cached}"
        assert [c.usage.completion_tokens for c in first + second] == [4] * 12
        outcomes = {k.decode(): int(v) for k, v in r.hgetall(stack.keys.routing(MODEL)).items()}
        assert outcomes.get("cache", 0) >= len(systems), outcomes
        stack.assert_clean()
    finally:
        stack.stop()


# ---- cost per request, 5 and 100 simulated nodes ---------------------------------------------------

MODELS = [f"m-{i:02d}" for i in range(20)]
NODE_KEY_READS = {"HGETALL", "HGET", "HMGET", "HLEN", "HKEYS", "HVALS", "EXISTS", "HEXISTS"}


def _sim_catalogue() -> str:
    return "".join(
        f'[[models]]\nid = "{m}"\nsource = "sim:{m}"\nmemory_mb = 100\nslots = 4\npin = true\n'
        for m in MODELS
    )


def _mix(base_urls: list[str], n: int) -> None:
    """The fixed request mix: chats sharing 4 system prompts (each on one model) and short ones
    over every model, sent over the gateways in turn."""
    for i in range(n):
        url = base_urls[i % len(base_urls)]
        if i % 2:
            system = f"Assistant {i % 4}. " + "Answer briefly and stay polite. " * 4
            _chat(url, system, f"Question {i}", model=MODELS[(i % 4) * 5])
        else:
            _chat(url, "Be short.", f"Item {i}", model=MODELS[i % len(MODELS)])


def _gateway_commands(stack: Stack, pids: list[int], work) -> tuple[Counter, float]:
    """(command, key kind) -> how many the gateway processes sent while `work()` ran, and its
    seconds (MONITOR: a command's client port tells whose it is)."""
    lines: list[tuple[int, str]] = []
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    done = threading.Event()
    with client.monitor() as monitor:

        def listen() -> None:
            while not done.is_set():
                try:
                    seen = monitor.next_command()
                except (redis.RedisError, OSError, ValueError):
                    return
                lines.append((int(seen["client_port"] or 0), seen["command"]))

        reader = threading.Thread(target=listen, daemon=True)
        reader.start()
        t0 = time.monotonic()
        try:
            work()
        finally:
            took = time.monotonic() - t0
            done.set()
            reader.join(5)
    redis_port = stack.client().connection_pool.connection_kwargs["port"]
    ports = {
        c.laddr.port
        for pid in pids
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == redis_port
    }
    counted: Counter = Counter()
    for port, command in lines:
        if port in ports:
            words = command.split()
            key = words[1] if len(words) > 1 else ""
            counted[(words[0].upper(), "node" if key.startswith(stack.keys.node("")) else "")] += 1
    return counted, took


def _per_request(stack: Stack, pids: list[int], requests: int) -> Counter:
    """The gateways' commands for `requests` of the mix, less what they send meanwhile when idle
    (their metrics refresh), measured over as long right after."""
    busy, took = _gateway_commands(stack, pids, lambda: _mix(stack.replicas, requests))
    idle, _ = _gateway_commands(stack, pids, lambda: time.sleep(took))
    return Counter({k: v - idle.get(k, 0) for k, v in busy.items() if v > idle.get(k, 0)})


def test_commands_per_request_do_not_grow_with_the_fleet(tmp_path):
    stack = start_stack(
        tmp_path,
        _sim_catalogue(),
        CORTEX_JANITOR_INTERVAL_S="3600",  # the janitor's sweep is not a request's work
        CORTEX_LOG_LEVEL="WARNING",
    )
    try:
        stack.start_gateways(2)
        pids = [s.proc.pid for s in stack.services if s.name == "gateway"]
        two_each = (
            MODELS + MODELS[1:] + MODELS[:1]
        )  # two replicas a model: routing runs at both sizes
        simulate(stack, 5, two_each, step_ms=2)
        _mix(stack.replicas, 8)  # warm every path
        small = _per_request(stack, pids, 40)
        spread = [MODELS[k % len(MODELS)] for k in range(100)]
        simulate(stack, 95, spread, first=5, fleet_size=100, step_ms=2)
        _mix(stack.replicas, 8)
        large = _per_request(stack, pids, 40)
        scans = {k: v for k, v in large.items() if k[0] in ("SCAN", "KEYS")}
        node_reads = sum(v for (name, kind), v in large.items() if kind == "node")
        assert not scans, f"no request scans the keyspace: {scans}"
        assert node_reads <= 40, f"no request reads every node's heartbeat: {node_reads} reads"
        assert sum(large.values()) <= 1.2 * sum(small.values()), (
            f"5 nodes: {sum(small.values())} commands ({small.most_common(8)}); "
            f"100 nodes: {sum(large.values())} ({large.most_common(8)})"
        )
    finally:
        stack.stop()
