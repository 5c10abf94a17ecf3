"""How Redis keeps its data, read from a real redis-server set up in each way: warnings for one that
keeps nothing, keeps only snapshots, may evict keys, or is nearly full."""

import logging
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from shared.redis_health import inspect, warn_if_not_durable

pytestmark = pytest.mark.integration


@pytest.fixture
def configurable(redis_url: str) -> Iterator[redis.Redis]:
    """The session's redis-server; whatever a test changes in its configuration is put back."""
    client = redis.Redis.from_url(redis_url)
    saved = {
        name: client.config_get(name)[name]
        for name in ("appendonly", "save", "maxmemory-policy", "maxmemory")
    }
    yield client
    for name, value in saved.items():
        client.config_set(name, value)
    client.close()


async def read(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await inspect(client)
    finally:
        await client.aclose()


async def test_a_redis_that_keeps_nothing_is_named(configurable, redis_url, caplog):
    health = await read(redis_url)
    assert (health.aof, health.snapshots, health.persistence) == (False, "", "none")
    assert [w.split(" (")[0] for w in health.warnings] == ["Redis keeps nothing on disk"]

    client = aioredis.Redis.from_url(redis_url)
    with caplog.at_level(logging.WARNING):
        await warn_if_not_durable(client, logging.getLogger("test"))
    await client.aclose()
    assert (
        len(caplog.records) == 1 and "Redis keeps nothing on disk" in caplog.records[0].getMessage()
    )


async def test_snapshots_alone_and_eviction_are_warned_of(configurable, redis_url):
    configurable.config_set("save", "300 10")
    configurable.config_set("maxmemory-policy", "allkeys-lru")
    health = await read(redis_url)
    assert health.persistence == "snapshots (save 300 10)"
    assert [w.split(" (")[0] for w in health.warnings] == [
        "Redis has no append-only file",
        "Redis may evict keys when full",
    ]


async def test_a_durable_redis_gets_no_warning(configurable, redis_url, caplog):
    configurable.config_set("appendonly", "yes")
    configurable.config_set("save", "3600 1")
    health = await read(redis_url)
    assert health.persistence == "append-only file (fsync everysec) + snapshots (save 3600 1)"
    assert health.warnings == []

    client = aioredis.Redis.from_url(redis_url)
    with caplog.at_level(logging.WARNING):
        await warn_if_not_durable(client, logging.getLogger("test"))
    await client.aclose()
    assert caplog.records == []


async def test_memory_used_against_maxmemory(configurable, redis_url):
    used = configurable.info("memory")["used_memory"]
    configurable.config_set("maxmemory", int(used * 1.05))
    health = await read(redis_url)
    assert health.maxmemory_mb == pytest.approx(used * 1.05 / (1 << 20), rel=0.01)
    assert any(w.startswith("Redis is nearly full") for w in health.warnings)
