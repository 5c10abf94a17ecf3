"""Tensor parallelism over NCCL (rank 0 on cuda:0 in this process, a worker on cuda:1): the same
checks as tests/unit/node_agent/test_tensor_parallel.py runs over gloo. Needs two GPUs; skipped
with one (no multi-GPU host has run it yet)."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from node_agent.engine.engine import Engine
from node_agent.tp import tensor_parallel
from shared.settings import NodeSettings
from tests.gpu.conftest import load
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent import engine_driver as driver
from tests.unit.node_agent.test_tensor_parallel import children, requests

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs"
)
GPUS = ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_gpus_generate_what_one_does(gpu_tiny_dirs, arch):
    profile, lm = load(gpu_tiny_dirs[arch], slots=4, prefill_chunk_tokens=16)
    expected = driver.run(Engine(lm, profile), *requests())
    sharded = profile.model_copy(update={"tensor_parallel": 2})
    engine = Engine(tensor_parallel.load(sharded, GPUS, NodeSettings(tp_timeout_s=20)), sharded)
    try:
        got = driver.run(engine, *requests())
    finally:
        engine.drop_model()
    assert {j: r.token_ids for j, r in got.items()} == {j: r.token_ids for j, r in expected.items()}
    assert not dist.is_initialized() and not children()


def test_a_killed_gpu_worker_poisons_the_group(gpu_tiny_dirs):
    profile = tiny_profile(gpu_tiny_dirs["llama"], slots=4, tensor_parallel=2)
    loaded = tensor_parallel.load(profile, GPUS, NodeSettings(tp_timeout_s=10))
    engine = Engine(loaded, profile)
    driver.add(
        engine,
        driver.request("a", "Hello there", kind="completion", max_tokens=50, ignore_eos=True),
    )
    engine.step()
    os.kill(loaded.group.workers[0].pid, signal.SIGKILL)
    with pytest.raises(tensor_parallel.RankFailed):
        for _ in range(50):
            engine.step()
    engine.fail_all()
    engine.drop_model()
    assert not dist.is_initialized() and not children()
