"""Live nodes from heartbeats, and whether a model is served."""

import pytest

from gateway.fleet import Fleet
from shared.catalog import ModelProfile
from shared.errors import ModelUnavailable
from shared.lifecycle import ModelState
from tests.unit.gateway.conftest import KEYS, MODEL, beat

PROFILE = ModelProfile(id=MODEL, source="x")


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


@pytest.mark.parametrize("state", [ModelState.READY, ModelState.LOADING])
async def test_served_when_ready_or_loading(fleet, redis, state):
    await beat(redis, "a", {MODEL: state})
    await fleet.ensure_served(PROFILE)


@pytest.mark.parametrize("state", [ModelState.POISONED, ModelState.UNLOADING, ModelState.FAILED])
async def test_not_served_otherwise(fleet, redis, state):
    await beat(redis, "a", {MODEL: state})
    with pytest.raises(ModelUnavailable, match=f"1 live nodes: a \\({MODEL} {state}\\)") as caught:
        await fleet.ensure_served(PROFILE)
    assert caught.value.status == 503


async def test_draining_node_does_not_count(fleet, redis):
    await beat(redis, "a", state="draining")
    with pytest.raises(ModelUnavailable, match="a \\(draining; "):
        await fleet.ensure_served(PROFILE)
    assert await fleet.serving_nodes() == []


async def test_positive_answer_is_cached_briefly_negative_never(fleet, redis):
    with pytest.raises(ModelUnavailable):
        await fleet.ensure_served(PROFILE)
    await beat(redis, "a")
    await fleet.ensure_served(PROFILE)  # not cached when it failed
    await redis.flushall()
    await fleet.ensure_served(PROFILE)  # cached for SERVED_CACHE_S
