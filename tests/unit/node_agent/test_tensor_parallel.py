"""Tensor parallelism on CPU over gloo: an engine on rank 0 (this process) with one spawned worker
rank equals the engine on one device; what cannot be sharded is refused before any process
starts; a killed worker fails the next step at once and the group tears down without leftovers."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from transformers import AutoConfig

from node_agent.engine.engine import Engine
from node_agent.model import devices, loader
from node_agent.tp import tensor_parallel
from shared.catalog import ModelProfile
from shared.model_files import ModelLoadError
from shared.processes import free_port
from shared.settings import NodeSettings
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent import engine_driver as driver

SETTINGS = NodeSettings(tp_timeout_s=20, torch_threads=1)
CPUS = ["cpu:0", "cpu:1"]


def sharded(folder, tensor_parallel: int = 2) -> ModelProfile:
    return tiny_profile(folder, slots=4, prefill_chunk_tokens=16, tensor_parallel=tensor_parallel)


def requests() -> list:
    """More jobs than slots (rows are packed as they finish), long prompts read in 16-token chunks,
    n=2, and logprobs of the prompt (lm_head on hidden states every rank must score) and output."""
    jobs = [
        driver.request(
            f"j{i}", p, kind="completion", max_tokens=8 + i, temperature=0, ignore_eos=True
        )
        for i, p in enumerate(driver.PROMPTS)
    ]
    jobs.append(
        driver.request(
            "echo",
            driver.PROMPTS[-1],
            kind="completion",
            max_tokens=4,
            temperature=0,
            prompt_logprobs=2,
            logprobs=True,
            top_logprobs=2,
            n=2,
        )
    )
    return jobs


@pytest.fixture
def new_children():
    """The child processes started since the test began (other tests' Redis servers and node
    agents, alive for their module or session, are not this test's)."""
    before = children()
    return lambda: children() - before


def children() -> set[int]:
    pids = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return {
        p for p in pids if os.path.exists(f"/proc/{p}") and "resource_tracker" not in _cmdline(p)
    }


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def test_two_ranks_generate_what_one_device_does(tiny_dirs, new_children):
    folder = tiny_dirs["llama"]
    single = Engine(loader.load(tiny_profile(folder), "cpu"), sharded(folder, tensor_parallel=1))
    expected = driver.run(single, *requests())
    engine = Engine(tensor_parallel.load(sharded(folder), CPUS, SETTINGS), sharded(folder))
    try:
        assert (
            engine.cache.layers[0].keys.shape[0] == 1
        )  # rank 0 holds one of the two KV heads ([heads, slots, dim])
        with pytest.raises(
            ModelLoadError, match="already runs tensor-parallel model llama; one per node agent"
        ):
            tensor_parallel.load(sharded(tiny_dirs["qwen3"]), CPUS, SETTINGS)
        got = driver.run(engine, *requests())
    finally:
        engine.drop_model()
    for job, want in expected.items():
        assert got[job].token_ids == want.token_ids, job
        assert got[job].text == want.text
    for mine, theirs in zip(got["echo"].logprobs[0], expected["echo"].logprobs[0]):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert not dist.is_initialized() and not new_children()


@pytest.mark.parametrize(
    "how, within_s", [(signal.SIGKILL, (0, 5)), (signal.SIGSTOP, (5, 15))], ids=["killed", "hung"]
)
def test_a_lost_worker_fails_the_next_step_and_nothing_is_left(
    tiny_dirs, how, within_s, new_children
):
    """Killed: its connections close and the next step fails at once. Hung: the step fails once
    the collective timeout (5 s here) passes."""
    profile = sharded(tiny_dirs["llama"])
    loaded = tensor_parallel.load(profile, CPUS, NodeSettings(tp_timeout_s=5, torch_threads=1))
    engine = Engine(loaded, profile)
    (worker,) = loaded.group.workers
    driver.add(
        engine,
        driver.request("a", "Hello there", kind="completion", max_tokens=50, ignore_eos=True),
    )
    engine.step()
    os.kill(worker.pid, how)
    started = time.monotonic()
    with pytest.raises(tensor_parallel.RankFailed) as failed:
        for _ in range(50):
            engine.step()
    assert within_s[0] <= time.monotonic() - started < within_s[1]
    assert devices.is_device_fault(failed.value, loaded.device)
    with pytest.raises(
        tensor_parallel.RankFailed, match="broken"
    ):  # nothing more runs on a broken group
        engine.step()
    engine.fail_all()
    engine.drop_model()
    assert not dist.is_initialized() and not new_children() and worker.exitcode == -signal.SIGKILL


def config(model_type: str, **fields):
    return AutoConfig.for_model(
        model_type, **{"num_attention_heads": 4, "num_key_value_heads": 2} | fields
    )


@pytest.mark.parametrize(
    "model_config, device_ids, reason",
    [
        (config("llama"), ["cpu:0"], "tensor_parallel = 2 needs 2 devices on one node; n1 has 1"),
        (config("gpt2"), CPUS, "model_type 'gpt2' has no tensor-parallel plan"),
        (
            config("llama", num_key_value_heads=1),
            CPUS,
            r"must divide the attention heads \(4\) and the key/value heads "
            r"\(1\)",
        ),
        (config("mistral", sliding_window=64), CPUS, "full-attention layers only"),
        (config("qwen3_moe", num_experts=4), CPUS, "mixture-of-experts"),
    ],
)
def test_what_cannot_be_sharded_is_refused_up_front(model_config, device_ids, reason):
    with pytest.raises(ModelLoadError, match=reason):
        tensor_parallel.check(
            ModelProfile(id="m", source="x", tensor_parallel=2), model_config, device_ids, "n1"
        )


def test_a_second_tensor_parallel_model_in_one_process_is_refused():
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    try:
        with pytest.raises(ModelLoadError, match="already runs tensor-parallel model"):
            tensor_parallel.check(
                ModelProfile(id="m", source="x", tensor_parallel=2), config("llama"), CPUS
            )
    finally:
        dist.destroy_process_group()


HOLD_A_GROUP = """
import sys, time
from node_agent.tp import tensor_parallel
from node_agent.engine.engine import Engine
from shared.catalog import ModelProfile
from shared.settings import NodeSettings
profile = ModelProfile.model_validate_json(sys.argv[1])
engine = Engine(tensor_parallel.load(profile, ["cpu:0", "cpu:1"], NodeSettings(torch_threads=1)), profile)
print(engine.lm.group.workers[0].pid, flush=True)
time.sleep(600)
"""


def test_workers_of_a_killed_node_agent_leave_too(tiny_dirs):
    """Rank 0's process killed with -9 (no clean-up at all): its workers see their connection
    close and exit; none is left behind."""
    agent = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_GROUP, sharded(tiny_dirs["llama"]).model_dump_json()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    try:
        worker = int(agent.stdout.readline())
    finally:
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 20
    while (
        Path(f"/proc/{worker}").exists() and _state(worker) != "Z" and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert (
        not Path(f"/proc/{worker}").exists() or _state(worker) == "Z"
    )  # gone (or exited, awaiting its reaper)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_worker_that_dies_before_joining_fails_the_load_at_once(tiny_dirs, new_children):
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"rank1 exited \(code 1\) before joining"):
        tensor_parallel.load(
            sharded(tiny_dirs["llama"]), ["cpu:0", "cuda:7"], SETTINGS
        )  # no such device here
    assert time.monotonic() - started < 60 and not dist.is_initialized() and not new_children()
