"""A node killed under traffic, and a node drained under traffic."""

import subprocess
import sys
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import wait_for

pytestmark = pytest.mark.integration
TWO_REPLICAS = {"tiny-a": {"max_replicas": 2, "slots": 4}}


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=120
    )


def run_requests(
    stack, count: int, max_tokens: int, spacing_s: float = 0.0
) -> tuple[list, list[threading.Thread]]:
    """`count` requests, half streaming; each thread appends (streamed, outcome) where outcome is
    "ok" or the error it got."""
    outcomes: list = []

    def one(i: int) -> None:
        streamed = i % 2 == 0
        try:
            kw = dict(
                model="tiny-a",
                prompt=f"Hello {i}",
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            if streamed:
                tokens = sum(
                    1
                    for chunk in client(stack).completions.create(stream=True, **kw)
                    if chunk.choices
                )
                assert tokens > 0
            else:
                assert client(stack).completions.create(**kw).usage.completion_tokens == max_tokens
            outcomes.append((streamed, "ok"))
        except openai.APIError as exc:
            outcomes.append((streamed, exc))

    threads = []
    for i in range(count):
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
        time.sleep(spacing_s)
    return outcomes, threads


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not [t for t in threads if t.is_alive()], "a request hung"


@pytest.mark.models(**TWO_REPLICAS)
def test_killed_node_loses_only_its_streams_and_leaves_nothing_pending(fleet_stack):
    fleet_stack.start_gateway()
    victim = fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    fleet_stack.start_node("n2", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    outcomes, threads = run_requests(fleet_stack, 20, max_tokens=120)
    wait_for(lambda: fleet_stack.jobs_held_by("n1") > 0, 30, "n1 to be busy")
    victim.proc.kill()  # SIGKILL: no clean shutdown, its heartbeat just stops
    join_all(threads, 90)
    assert len(outcomes) == 20
    for streamed, outcome in outcomes:
        if outcome == "ok":
            continue
        assert streamed, f"a non-streaming request failed instead of being retried: {outcome}"
        assert "node_lost" in str(getattr(outcome, "body", "")) or "lost" in str(outcome)
    assert sum(o == "ok" for _, o in outcomes) >= 10  # every non-streaming one at least
    fleet_stack.assert_clean(timeout_s=15)
    r = fleet_stack.client()
    consumers = r.xinfo_consumers(fleet_stack.keys.jobs("tiny-a"), "agents")
    assert [c["name"] for c in consumers] in ([b"n2"], ["n2"])  # the dead consumer was removed


@pytest.mark.models(**TWO_REPLICAS)
def test_drain_under_traffic_fails_nothing(fleet_stack):
    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    fleet_stack.start_node("n2", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    outcomes, threads = run_requests(fleet_stack, 24, max_tokens=60, spacing_s=0.1)
    wait_for(lambda: fleet_stack.jobs_held_by("n1") > 0, 30, "n1 under traffic")
    drained = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "drain", "n1"],
        env=fleet_stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert drained.returncode == 0, drained.stderr
    join_all(threads, 120)
    assert [o for _, o in outcomes if o != "ok"] == []
    wait_for(
        lambda: fleet_stack.client().hget(fleet_stack.keys.node("n1"), "state") == b"drained",
        30,
        "n1 drained",
    )
    assert fleet_stack.models_on("n1") == {}
    fleet_stack.assert_clean()


@pytest.mark.models(**{"tiny-a": {}})
def test_metrics_count_what_was_served(fleet_stack):
    import httpx

    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    for i in range(5):
        answer = client(fleet_stack).completions.create(
            model="tiny-a", prompt="Hi", max_tokens=3, stream=i % 2 == 0
        )
        if i % 2 == 0:
            list(
                answer
            )  # to its end: a request counts at its done event, which nobody reads once its client left

    def metrics() -> dict:
        return {
            f.name: f
            for f in text_string_to_metric_families(
                httpx.get(f"{fleet_stack.gateway_url}/metrics").text
            )
        }

    def prefix_cache_queries() -> float:
        family = metrics().get("vllm:prefix_cache_queries")
        return sum(s.value for s in family.samples) if family else 0

    wait_for(
        lambda: prefix_cache_queries() > 0,
        10,
        "the fleet gauges (refreshed every 2 s) to count the node's prompts",
    )
    families = metrics()
    ttft_count = sum(
        s.value
        for s in families["cortex:time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    )
    assert ttft_count == 5
    success = [s for s in families["cortex:request_success"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in success) == 5 and all(s.labels["node"] == "n1" for s in success)
    for name in (
        "cortex:generation_tokens",
        "cortex:prompt_tokens",
        "cortex:e2e_request_latency_seconds",
        "cortex:request_queue_time_seconds",
        "cortex:inter_token_latency_seconds",
        "cortex:requests_running",
        "cortex:requests_waiting",
        "cortex:node_memory_total_bytes",
        "cortex:model_slots_total",
    ):
        assert name in families, name
    assert [s.value for s in families["cortex:node_memory_total_bytes"].samples] == [500 * 2**20]
    # the node's KV cache, through its heartbeat, under vLLM's names
    (usage,) = families["vllm:kv_cache_usage_perc"].samples
    assert usage.labels == {"model": "tiny-a", "node": "n1"} and 0 <= usage.value <= 1
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
        assert families[name].type == "counter"
        assert [(s.name, s.labels) for s in families[name].samples] == [
            (f"{name}_total", usage.labels)
        ]
    assert families["vllm:prefix_cache_queries"].samples[0].value > 0  # five prompts were looked up


@pytest.mark.models(**{"tiny-a": {"max_replicas": 2, "slots": 1}})
def test_queue_depth_starts_another_replica(fleet_stack):
    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    fleet_stack.start_node("n2", models=[], CORTEX_MEMORY_BUDGET_MB="500")
    outcomes, threads = run_requests(
        fleet_stack, 12, max_tokens=150
    )  # 1 slot: 11 wait, past 4 per replica
    wait_for(lambda: "tiny-a" in fleet_stack.models_on("n2"), 30, "a second replica on n2")
    join_all(threads, 120)
    assert [o for _, o in outcomes if o != "ok"] == []
    fleet_stack.assert_clean()


@pytest.mark.models(**{"tiny-a": {"slots": 1, "max_model_len": 512}})
def test_a_client_that_leaves_while_queued_takes_its_job_back(fleet_stack):
    """A job whose client left before any node read it is withdrawn from its stream: no node runs
    it for nobody (a cancel alone would reach no node: none runs it yet)."""
    fleet_stack.start_gateway()
    node = fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    ahead = [
        client(fleet_stack).completions.create(
            model="tiny-a",
            prompt=f"Hello {i}",
            max_tokens=480,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i in range(8)
    ]
    impatient = openai.OpenAI(
        base_url=f"{fleet_stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=1.0
    )
    with pytest.raises(openai.APITimeoutError):  # 8 jobs of 480 tokens ahead on one slot
        impatient.completions.create(model="tiny-a", prompt="Hello again", max_tokens=50)
    for stream in ahead:
        assert sum(1 for chunk in stream if chunk.choices) > 0
    fleet_stack.assert_clean(timeout_s=30)
    assert node.log_path.read_text().count(" admitted from ") == 8  # the impatient job never ran
