"""`cortex backup PATH`: a consistent snapshot of Redis (BGSAVE, waited for) copied to PATH. Redis
writes the snapshot on its own host, so this runs where Redis keeps its files (the machine of
`cortex up`, or a shell in the Redis container); elsewhere `redis-cli --rdb PATH` fetches one over
the network. To restore: stop the stack, put the file in place of `dump.rdb` in Redis's directory,
remove `appendonlydir/` beside it, start again (`cortex up` loads the snapshot, then writes its
append-only file; docs/operations.md#backup-and-restore says how for another Redis)."""

import asyncio
import shutil
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

POLL_S = 0.1


class BackupFailed(Exception):
    pass


async def _saving(redis: aioredis.Redis) -> bool:
    return bool((await redis.info("persistence"))["rdb_bgsave_in_progress"])


async def snapshot(redis: aioredis.Redis, timeout_s: float) -> Path:
    """Take a snapshot that holds every write made before this call; returns where Redis wrote it."""
    deadline = time.monotonic() + timeout_s
    while (
        True
    ):  # BGSAVE is refused while a snapshot or an AOF rewrite runs: wait for it, then ask again
        try:
            await redis.bgsave()
            break
        except ResponseError as exc:
            if "in progress" not in str(exc):
                raise BackupFailed(f"Redis refused BGSAVE: {exc}") from exc
        if time.monotonic() > deadline:
            raise BackupFailed(f"Redis was busy saving for {timeout_s:g}s")
        await asyncio.sleep(POLL_S)
    while await _saving(redis):  # ours, started by the BGSAVE Redis accepted
        if time.monotonic() > deadline:
            raise BackupFailed(f"the snapshot did not finish within {timeout_s:g}s")
        await asyncio.sleep(POLL_S)
    if (await redis.info("persistence"))["rdb_last_bgsave_status"] != "ok":
        raise BackupFailed("Redis could not write the snapshot; its log says why")
    config = await redis.config_get("dir") | await redis.config_get("dbfilename")
    return Path(config["dir"]) / config["dbfilename"]


async def backup(redis: aioredis.Redis, path: Path, timeout_s: float = 600.0) -> int:
    """Snapshot Redis and copy the snapshot to `path` (atomically); returns its size in bytes."""
    source = await snapshot(redis, timeout_s)
    if not source.is_file():
        raise BackupFailed(
            f"Redis wrote its snapshot to {source} on its own host, which is not reachable from here: "
            f"run this where Redis runs, or use `redis-cli -u URL --rdb {path}`"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(path)
    return path.stat().st_size
