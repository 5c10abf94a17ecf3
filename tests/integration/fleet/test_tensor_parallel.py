"""Tensor-parallel models (TP=2 over gloo, two logical CPU devices per node) through the gateway:
greedy output equals TP=1 under continuous batching with chunked prefill and concurrent
streams; disconnects at random points leave the ranks in step; a worker rank killed under
traffic fails its jobs cleanly, the model reloads with fresh ranks, and nothing is left over;
what cannot be sharded is a load error the status and the waiting requests show.

One fleet for the module: n1 serves tiny Llama at TP=1 and TP=2, n2 tiny Qwen3 at TP=1 and TP=2
(a node agent runs one tensor-parallel model at a time; placement swaps them)."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests import tiny_models
from tests.integration.fleet.conftest import catalogue
from tests.integration.fleet.test_failures import join_all
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration

TP_TIMEOUT_S = 10
SHARED = {"slots": 4, "prefill_chunk_tokens": 16, "max_model_len": 256}
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a poem about the sea and the sky, and then about the wind "
    "over the hills and the rain that falls on the town at night",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Why?",
    "Tell me about transformers and attention in detail please, with examples and a summary",
    "Hello there! Why? What is it?",
    "Paris",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dirs, smol_tokenizer):
    root = tmp_path_factory.mktemp("tp")
    gpt2 = tiny_models.build("llama", root / "gpt2", smol_tokenizer, model_type="gpt2")
    one_kv_head = tiny_models.build("llama", root / "kv1", smol_tokenizer, num_key_value_heads=1)
    models = {
        "llama-tp1": {"source": str(tiny_dirs["llama"]), "nodes": ["n1"]},
        "llama-tp2": {"source": str(tiny_dirs["llama"]), "nodes": ["n1"], "tensor_parallel": 2},
        "llama-tp4": {"source": str(tiny_dirs["llama"]), "nodes": ["n1"], "tensor_parallel": 4},
        "qwen3-tp1": {"source": str(tiny_dirs["qwen3"]), "nodes": ["n2"]},
        "qwen3-tp2": {"source": str(tiny_dirs["qwen3"]), "nodes": ["n2"], "tensor_parallel": 2},
        "llama-n2-tp2": {"source": str(tiny_dirs["llama"]), "nodes": ["n2"], "tensor_parallel": 2},
        "gpt2-tp2": {"source": str(gpt2), "nodes": ["n2"], "tensor_parallel": 2},
        "kv1-tp2": {"source": str(one_kv_head), "nodes": ["n2"], "tensor_parallel": 2},
    }
    shm_before = set(os.listdir("/dev/shm"))
    stack = start_stack(
        root,
        catalogue(tiny_dirs["llama"], **{m: SHARED | p for m, p in models.items()}),
        CORTEX_HEARTBEAT_S="0.5",
        CORTEX_HEARTBEAT_TTL_S="3",
        CORTEX_NODE_TTL_S="3",
        CORTEX_CPU_DEVICES="2",
        CORTEX_MEMORY_BUDGET_MB="1000",
        CORTEX_TP_TIMEOUT_S=str(TP_TIMEOUT_S),
        CORTEX_TORCH_THREADS="1",
    )
    try:
        stack.start_gateway()
        stack.nodes = {
            "n1": stack.start_node("n1", models=["llama-tp1", "llama-tp2"]),
            "n2": stack.start_node("n2", models=["qwen3-tp1", "qwen3-tp2"]),
        }
        for node, model in (("n1", "llama-tp2"), ("n2", "qwen3-tp2")):
            wait_for(lambda: ready(stack, node, model), 120, f"{model} ready on {node}")
        yield stack
    finally:
        stack.stop()
    assert set(os.listdir("/dev/shm")) <= shm_before, "shared memory left behind"


def ready(stack, node: str, model: str) -> bool:
    return stack.models_on(node).get(model, {}).get("state") == "ready"


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=120
    )


def complete(stack, model: str, prompt: str, stream: bool, max_tokens: int = 24) -> str:
    kw = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if stream:
        return "".join(
            c.choices[0].text
            for c in client(stack).completions.create(stream=True, **kw)
            if c.choices
        )
    return client(stack).completions.create(**kw).choices[0].text


def answers(stack, model: str, prompts: list[str]) -> list[str]:
    """Every prompt at once (half of them streamed), so they share engine steps and prefill chunks."""
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = complete(stack, model, prompts[i], stream=i % 2 == 0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    join_all(threads, 120)
    return out


def workers(node) -> set[int]:
    """The node's tensor-parallel worker processes (spawned children; not multiprocessing's tracker)."""
    pids = set()
    for task in os.listdir(f"/proc/{node.proc.pid}/task"):
        pids |= {
            int(p) for p in Path(f"/proc/{node.proc.pid}/task/{task}/children").read_text().split()
        }
    return {p for p in pids if "spawn_main" in _cmdline(p)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_answer_as_one_device_does(stack, arch):
    assert answers(stack, f"{arch}-tp2", PROMPTS) == answers(stack, f"{arch}-tp1", PROMPTS)
    node = "n1" if arch == "llama" else "n2"
    assert sorted(stack.models_on(node)[f"{arch}-tp2"]["devices"]) == [
        "cpu:0",
        "cpu:1",
    ]  # one replica on both
    assert len(workers(stack.nodes[node])) == 1


def test_disconnects_at_random_points_leave_the_ranks_in_step(stack):
    rng = random.Random(7)

    def abandon(i: int) -> None:
        kw = dict(
            model="llama-tp2",
            prompt=PROMPTS[i % len(PROMPTS)] * (1 + i % 3),
            max_tokens=150,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        stream = client(stack).completions.create(stream=True, **kw)
        for _ in range(rng.randrange(0, 40)):
            next(stream, None)
        stream.close()  # the client goes away mid-generation (or before its first token)

    threads = [threading.Thread(target=abandon, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.2)
    join_all(threads, 120)
    wait_for(
        lambda: stack.models_on("n1")["llama-tp2"]["slots_used"] == 0,
        30,
        "the cancelled jobs to leave",
    )
    prompts = PROMPTS + PROMPTS[:2]
    assert answers(stack, "llama-tp2", prompts) == answers(stack, "llama-tp1", prompts)


def test_a_killed_worker_fails_in_flight_jobs_cleanly_then_the_model_reloads(stack):
    """The jobs running when a rank dies fail with `model_poisoned`, at once; jobs still queued wait
    for the reload and are served by it."""
    n1 = stack.nodes["n1"]
    (victim,) = workers(n1)
    outcomes: list = []

    def one(i: int) -> None:
        try:
            complete(stack, "llama-tp2", PROMPTS[i], stream=i % 2 == 0, max_tokens=200)
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append((exc, time.monotonic()))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    wait_for(
        lambda: stack.models_on("n1")["llama-tp2"]["slots_used"] > 0, 30, "llama-tp2 to be busy"
    )
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        lambda: stack.models_on("n1")["llama-tp2"]["state"] == "poisoned",
        10,
        "the heartbeat to say poisoned",
    )
    assert "RankFailed" in stack.models_on("n1")["llama-tp2"]["error"]
    join_all(threads, TP_TIMEOUT_S + 120)
    failed = [o for o in outcomes if o != "ok"]
    assert failed and all(
        "model_poisoned" in str(getattr(exc, "body", "")) + str(exc) for exc, _ in failed
    ), outcomes
    assert all(at - killed < TP_TIMEOUT_S + 5 for _, at in failed)
    wait_for(lambda: ready(stack, "n1", "llama-tp2"), 120, "llama-tp2 to reload")
    assert gone(victim) and len(workers(n1)) == 1
    assert answers(stack, "llama-tp2", PROMPTS[:4]) == answers(stack, "llama-tp1", PROMPTS[:4])
    assert "rank group of llama-tp2 failed" in n1.log_path.read_text()


def test_a_node_swaps_its_idle_sharded_model_for_another(stack):
    before = workers(stack.nodes["n2"])
    assert answers(stack, "llama-n2-tp2", PROMPTS[:3]) == answers(stack, "llama-tp1", PROMPTS[:3])
    assert "qwen3-tp2" not in stack.models_on("n2")  # placement evicted it: one per node agent
    assert len(workers(stack.nodes["n2"])) == 1 and not before & workers(stack.nodes["n2"])
    wait_for(
        lambda: stack.models_on("n2")["llama-n2-tp2"]["slots_used"] == 0,
        10,
        "n2's heartbeat to say idle",
    )


def status(stack) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status", "--json"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return {n["node"]: n for n in json.loads(done.stdout)["nodes"]}


@pytest.mark.parametrize(
    "model, reason",
    [
        ("gpt2-tp2", "model_type 'gpt2' has no tensor-parallel plan"),
        ("kv1-tp2", "must divide the attention heads (4) and the key/value heads (1)"),
    ],
)
def test_what_cannot_be_sharded_fails_its_load_and_its_waiting_requests(stack, model, reason):
    with pytest.raises(openai.APIStatusError) as refused:
        complete(stack, model, "Hello", stream=False)
    assert refused.value.status_code == 503 and reason in refused.value.message
    error = status(stack)["n2"]["models"][model]
    assert error["state"] == "failed" and reason in error["error"]


def test_too_few_devices_is_refused_by_placement_and_by_the_node(stack):
    with pytest.raises(openai.APIStatusError, match="4 devices on one node") as refused:
        complete(stack, "llama-tp4", "Hello", stream=False)
    assert refused.value.status_code == 503
    loaded = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "models", "load", "llama-tp4", "--node", "n1"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert loaded.returncode == 0, loaded.stderr
    reason = "tensor_parallel = 4 needs 4 devices on one node; n1 has 2"
    wait_for(
        lambda: reason in stack.models_on("n1").get("llama-tp4", {}).get("error", ""),
        30,
        "the load to fail",
    )
    assert status(stack)["n1"]["models"]["llama-tp4"]["state"] == "failed"
    with pytest.raises(openai.APIStatusError, match="needs 4 devices"):
        complete(stack, "llama-tp4", "Hello", stream=False)


def test_a_stopped_node_stops_its_ranks(stack):
    n1 = stack.nodes["n1"]
    ranks = workers(n1)
    n1.proc.send_signal(signal.SIGTERM)
    n1.proc.wait(60)
    assert ranks and all(gone(pid) for pid in ranks)
