"""Placement: tensor-parallel models (N devices of one node, a share of the memory on each), the
nodes holding a model's files, and sleeping replicas (woken first, evicted first)."""

import asyncio

import pytest

from gateway.fleet.placement import Placer, candidates, plan
from shared.catalog import ModelProfile
from shared.errors import InsufficientCapacity
from shared.heartbeat import DeviceInfo, ModelInfo, NodeHeartbeat
from shared.lifecycle import ModelState
from tests.model_fixtures import tiny_profile
from tests.unit.shared.test_memory import awq_llama


def node(name: str, free_mb: list[int], **models: ModelInfo) -> NodeHeartbeat:
    devices = [
        DeviceInfo(id=f"cuda:{i}", name="gpu", total_mb=1000, free_mb=f)
        for i, f in enumerate(free_mb)
    ]
    return NodeHeartbeat(
        node=name, version="0", started_ms=0, heartbeat_ms=0, devices=devices, models=models
    )


def idle(memory_mb: int, *devices: str) -> ModelInfo:
    return ModelInfo(
        state=ModelState.READY, device=devices[0], devices=list(devices), memory_mb=memory_mb
    )


def asleep(memory_mb: int, last_used_ms: int = 0) -> ModelInfo:
    return ModelInfo(
        state=ModelState.SLEEPING,
        device="cuda:0",
        devices=["cuda:0"],
        memory_mb=memory_mb,
        last_used_ms=last_used_ms,
    )


def choose(profile: ModelProfile, share_mb: int, *nodes: NodeHeartbeat):
    return plan(profile, share_mb, candidates(profile, list(nodes), set(), set(), {}, "lru"))


TP2 = ModelProfile(id="big", source="x", tensor_parallel=2)


def test_a_sharded_model_needs_its_share_free_on_n_devices_of_one_node():
    # n1's second-emptiest device is too full; n2 has room on two devices; n3 has one device only
    chosen = choose(
        TP2, 300, node("n1", [900, 100]), node("n2", [400, 350, 10]), node("n3", [1000])
    )
    assert chosen.node == "n2" and chosen.free_mb == 50


def test_evicting_frees_memory_on_the_devices_the_evicted_model_holds():
    full = node("n1", [100, 100], a=idle(400, "cuda:1"), b=idle(300, "cuda:0"))
    chosen = choose(TP2, 350, full)
    assert chosen.evict == ["a", "b"] and chosen.free_mb == 50  # `a` alone frees cuda:1 only


def test_too_few_devices_anywhere_says_so():
    with pytest.raises(InsufficientCapacity, match="2 devices on one node"):
        choose(TP2, 10, node("n1", [1000]))


def test_a_node_takes_a_second_sharded_model_only_by_evicting_its_idle_first():
    sharded = idle(200, "cuda:0", "cuda:1")
    chosen = choose(TP2, 100, node("n1", [900, 900], first=sharded))
    assert chosen.evict == ["first"]  # room enough without it, but one process group per node agent
    busy = sharded.model_copy(update={"slots_used": 1})
    with pytest.raises(InsufficientCapacity, match="whose tensor-parallel model if any is idle"):
        choose(TP2, 100, node("n1", [900, 900], first=busy))
    assert (
        choose(ModelProfile(id="small", source="x"), 100, node("n1", [900, 900], first=busy)).evict
        == []
    )


def test_a_node_holding_the_model_files_goes_first_even_with_less_room_or_an_eviction():
    one = ModelProfile(id="m", source="hf:org/m")
    found = candidates(
        one,
        [node("roomy", [900]), node("holder", [150], old=idle(300, "cuda:0"))],
        set(),
        set(),
        {},
        "lru",
    )
    assert plan(one, 200, found).node == "roomy"  # no files anywhere: the fewest evictions
    chosen = plan(one, 200, found, holding=frozenset({"holder"}))
    assert chosen.node == "holder" and chosen.evict == [
        "old"
    ]  # an eviction costs less than a download


def test_a_sharded_quantized_model_is_placed_by_what_its_rank_0_holds(tmp_path):
    """An AWQ model whose tied embedding (64 MiB) is most of it: the node's loaders copy the
    embedding to each rank, so each device needs it whole, not half of the model."""
    profile = tiny_profile(
        awq_llama(tmp_path / "awq", vocab=65536, hidden=256, layers=2), slots=2, quant="auto"
    )
    whole = asyncio.run(Placer._estimate_mb(profile))
    per_device = asyncio.run(Placer._estimate_mb(profile.model_copy(update={"tensor_parallel": 2})))
    assert whole // 2 < 64 < per_device < whole
    with pytest.raises(InsufficientCapacity):
        choose(
            profile.model_copy(update={"tensor_parallel": 2}),
            per_device,
            node("n1", [per_device - 1] * 2),
        )


def test_a_model_sleeping_on_a_full_node_is_woken_there_before_a_load_anywhere():
    m = ModelProfile(id="m", source="hf:org/m")
    chosen = choose(m, 500, node("roomy", [900]), node("full", [10], m=asleep(400)))
    assert chosen.node == "full" and chosen.wakes and chosen.evict == []
    found = candidates(m, [node("full", [10], m=asleep(400))], set(), set(), {}, "lru")
    assert found[0].evictable == []  # its own sleeping replica is not evicted for it


def test_a_node_evicts_its_sleeping_models_before_its_idle_ready_ones():
    m = ModelProfile(id="m", source="x")
    full = node(
        "n1",
        [100],
        ready=idle(300, "cuda:0").model_copy(update={"last_used_ms": 1}),
        slept=asleep(300, last_used_ms=5),
        slept_long=asleep(300, last_used_ms=2),
    )
    assert choose(m, 350, full).evict == ["slept_long"]
    assert choose(m, 650, full).evict == ["slept_long", "slept"]
    assert choose(m, 950, full).evict == ["slept_long", "slept", "ready"]
    queued = candidates(m, [full], set(), {"slept_long"}, {}, "lru")
    assert queued[0].evictable == ["slept", "ready"]  # jobs wait for it: it is woken, not evicted
    pinned = candidates(m, [full], {"slept"}, set(), {}, "priority")
    assert pinned[0].evictable == ["slept_long", "ready"]
