"""Live nodes from heartbeats, and whether a model is served."""

import pytest

from shared.fleet import Fleet, describe
from shared.lifecycle import ModelState
from tests.unit.gateway.conftest import KEYS, MODEL, beat


@pytest.fixture
def fleet(redis):
    return Fleet(redis, KEYS, node_ttl_s=8.0)


async def test_live_nodes(fleet, redis):
    await beat(redis, "b")
    await beat(redis, "a")
    await beat(redis, "old", age_s=30)
    await redis.zadd(KEYS.nodes(), {"gone": 10**13})  # in the zset, but its hash expired
    await redis.zadd(KEYS.nodes(), {"garbled": 10**13})
    await redis.hset(KEYS.node("garbled"), mapping={"node": "garbled"})
    assert [n.node for n in await fleet.live_nodes()] == ["a", "b"]


@pytest.mark.parametrize("state", [ModelState.READY, ModelState.LOADING, ModelState.POISONED])
async def test_served_when_ready_loading_or_reloading_after_a_fault(fleet, redis, state):
    await beat(redis, "a", {MODEL: state})
    assert await fleet.is_served(MODEL)


@pytest.mark.parametrize("state", [ModelState.UNLOADING, ModelState.FAILED])
async def test_not_served_otherwise(fleet, redis, state):
    await beat(redis, "a", {MODEL: state})
    assert not await fleet.is_served(MODEL)
    assert describe(await fleet.live_nodes()) == f"a ({MODEL} {state})"


async def test_draining_node_does_not_count(fleet, redis):
    await beat(redis, "a", state="draining")
    assert not await fleet.is_served(MODEL)
    assert describe(await fleet.live_nodes()).startswith("a (draining; ")
    assert await fleet.serving_nodes() == []


async def test_positive_answer_is_cached_briefly_negative_never(fleet, redis):
    assert not await fleet.is_served(MODEL)
    await beat(redis, "a")
    assert await fleet.is_served(MODEL)  # not cached when it was no
    await redis.flushall()
    assert await fleet.is_served(MODEL)  # a yes is cached for SERVED_CACHE_S
    assert not await fleet.is_served(MODEL, fresh=True)
