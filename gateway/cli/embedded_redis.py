"""The redis-server `cortex up` runs. Durable by default: an append-only file fsynced every second
plus snapshots, in a data directory (`$XDG_DATA_HOME/cortex/redis`, `--redis-dir` moves it) that one
`cortex up` at a time holds (a lock file), so API keys, files, batches, stored responses and pins
survive Ctrl-C and a crash. A data directory holding a snapshot but no append-only file (a restored
`cortex backup`, or one written with persistence off) is loaded from the snapshot, then the
append-only file is turned on (Redis would otherwise start empty beside it)."""

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from shared import processes

SNAPSHOT = "dump.rdb"  # redis-server's default file names in its --dir
AOF_DIR = "appendonlydir"
LOCK_FILE = "cortex-up.lock"
AOF_ON_TIMEOUT_S = 300.0  # rewriting a restored snapshot into the append-only file


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/cortex/redis` (`~/.local/share/cortex/redis`)."""
    return (
        Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        / "cortex"
        / "redis"
    )


class DataDirBusy(Exception):
    pass


@dataclass
class EmbeddedRedis:
    port: int
    data_dir: Path | None  # None: no persistence (nothing survives a restart)
    logfile: str
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def describe(self) -> str:
        if self.data_dir is None:
            return "no persistence: nothing survives a restart"
        return f"append-only file fsynced every second + snapshots in {self.data_dir}"

    def hold_data_dir(self) -> None:
        """Create the data directory and lock it for this process's lifetime; DataDirBusy when
        another `cortex up` holds it (two servers writing one append-only file would corrupt it)."""
        if self.data_dir is None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.data_dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise DataDirBusy(
                f"{self.data_dir} is in use by `cortex up` pid {holder}; stop it or pass --redis-dir"
            )
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock = lock

    def restoring(self) -> bool:
        """A snapshot and no append-only file: load the snapshot, then turn the file on."""
        return (
            self.data_dir is not None
            and (self.data_dir / SNAPSHOT).exists()
            and not (self.data_dir / AOF_DIR).exists()
        )

    def argv(self) -> list[str]:
        durable = self.data_dir is not None and not self.restoring()
        return processes.redis_server_argv(
            self.port, workdir=self.data_dir, logfile=self.logfile, durable=durable
        )

    def turn_aof_on(self) -> None:
        """After loading a restored snapshot: the same settings as a durable start, applied live,
        and wait until the append-only file holds the data set."""
        client = redis.Redis.from_url(self.url, socket_timeout=10)
        try:
            client.config_set("appendfsync", "everysec")
            client.config_set("save", processes.SNAPSHOTS)
            client.config_set("stop-writes-on-bgsave-error", "no")
            client.config_set("appendonly", "yes")
            deadline = time.monotonic() + AOF_ON_TIMEOUT_S
            while time.monotonic() < deadline:
                info = client.info("persistence")
                if (
                    not info["aof_rewrite_in_progress"]
                    and not info["aof_rewrite_scheduled"]
                    and info["aof_enabled"]
                ):
                    return
                time.sleep(0.1)
            raise TimeoutError(f"the append-only file was not written within {AOF_ON_TIMEOUT_S:g}s")
        finally:
            client.close()
