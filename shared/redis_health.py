"""Whether the Redis under Cortex keeps what users store, and how full it is. API keys, files,
batches and stored responses live only in Redis (docs/redis.md marks every key durable or
ephemeral), so a Redis that keeps nothing on disk, or may evict keys when full, loses them. Every
part checks at start and logs one warning when it would (`warn_if_not_durable`); `/health` and
`cortex status` show the same reading (`inspect`)."""

import logging

import redis.asyncio as aioredis
from pydantic import BaseModel
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from shared.redis_conn import is_cluster

_MB = 1 << 20
FULL_AT = 0.9  # of maxmemory: past this, say that writes will soon be refused


class RedisHealth(BaseModel):
    version: str
    aof: bool  # an append-only file
    appendfsync: str | None  # always | everysec | no; None: CONFIG is not allowed here
    snapshots: str | None  # the `save` schedule ("" none); None: CONFIG is not allowed here
    eviction_policy: str  # maxmemory-policy: only `noeviction` never drops a key
    used_memory_mb: float
    maxmemory_mb: float  # 0: no limit
    warnings: list[str] = []

    @property
    def persistence(self) -> str:
        kept = [f"append-only file (fsync {self.appendfsync or '?'})"] if self.aof else []
        if self.snapshots:
            kept.append(f"snapshots (save {self.snapshots})")
        return " + ".join(kept) or (
            "none" if self.snapshots == "" else "no append-only file; snapshots unknown"
        )

    @property
    def memory(self) -> str:
        limit = (
            f"of {self.maxmemory_mb:.0f} MB maxmemory" if self.maxmemory_mb else "(no maxmemory)"
        )
        return f"{self.used_memory_mb:.1f} MB used {limit}"


async def inspect(redis: aioredis.Redis) -> RedisHealth:
    """INFO, and CONFIG GET where the server allows it (managed services often do not). On a
    cluster, the master that keeps least (no append-only file), then the fullest, speaks for all."""
    if is_cluster(redis):
        masters = (await redis.info(target_nodes=RedisCluster.PRIMARIES)).values()
        info = min(masters, key=lambda i: (bool(i.get("aof_enabled")), -i.get("used_memory", 0)))
    else:
        async with redis.pipeline(transaction=False) as pipe:
            for section in ("server", "persistence", "memory"):
                pipe.info(section)
            info = {k: v for section in await pipe.execute() for k, v in section.items()}
    try:
        config = await redis.config_get("save") | await redis.config_get("appendfsync")
    except ResponseError:
        config = {}
    health = RedisHealth(
        version=str(info.get("redis_version", "?")),
        aof=bool(info.get("aof_enabled")),
        appendfsync=config.get("appendfsync"),
        snapshots=config.get("save"),
        eviction_policy=str(info.get("maxmemory_policy", "?")),
        used_memory_mb=info.get("used_memory", 0) / _MB,
        maxmemory_mb=info.get("maxmemory", 0) / _MB,
    )
    health.warnings = _warnings(health, info)
    return health


def _warnings(health: RedisHealth, info: dict) -> list[str]:
    found = []
    if not health.aof and health.snapshots == "":
        found.append(
            'Redis keeps nothing on disk (appendonly no, save ""): API keys, files, batches and stored '
            "responses are lost when it restarts; run it with --appendonly yes --appendfsync everysec"
        )
    elif not health.aof:
        found.append(
            f"Redis has no append-only file (snapshots: {health.snapshots or 'unknown'}): what changed "
            "since its last snapshot is lost when it crashes; run it with --appendonly yes"
        )
    if health.eviction_policy != "noeviction":
        found.append(
            f"Redis may evict keys when full (maxmemory-policy {health.eviction_policy}): it could drop "
            "API keys, files, batches or queued jobs; set maxmemory-policy noeviction"
        )
    if health.aof and info.get("aof_last_write_status", "ok") != "ok":
        found.append("Redis could not write its append-only file: it refuses writes until it can")
    if info.get("rdb_last_bgsave_status", "ok") != "ok":
        found.append(
            "Redis's last snapshot failed (its log says why)"
            + (
                ""
                if health.aof
                else "; with stop-writes-on-bgsave-error yes it refuses writes until one succeeds"
            )
        )
    if health.maxmemory_mb and health.used_memory_mb >= FULL_AT * health.maxmemory_mb:
        found.append(
            f"Redis is nearly full ({health.memory}): writes are refused (503) once it is; delete "
            "files or raise maxmemory"
        )
    return found


async def warn_if_not_durable(redis: aioredis.Redis, log: logging.Logger) -> None:
    """At start: one warning line when the Redis would lose what users store (never raises)."""
    try:
        health = await inspect(redis)
    except Exception as exc:
        log.warning("could not check how Redis keeps its data: %s", exc)
        return
    if health.warnings:
        log.warning("Redis %s: %s", health.version, "; ".join(health.warnings))
