"""How every CLI verb finds the local stack: `cortex up` (what `scripts/serve` runs) writes a run
file naming its Redis and gateway, and removes it when it stops. A verb given no Redis (no
`--redis-url`, no `CORTEX_REDIS_URL`, no `redis_url` in the settings file) reads the run file of a
`cortex up` that is still running before it falls back to the default, and says which it used."""

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.redis_conn import redact
from shared.settings import GatewaySettings

RUN_FILE_ENV = "CORTEX_RUN_FILE"


def run_file_path() -> Path:
    """`$CORTEX_RUN_FILE`, else `$XDG_STATE_HOME/cortex/up.json` (`~/.local/state/cortex/up.json`)."""
    if os.environ.get(RUN_FILE_ENV):
        return Path(os.environ[RUN_FILE_ENV])
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "cortex" / "up.json"


@dataclass(frozen=True)
class RunFile:
    pid: int  # the `cortex up` process
    redis_url: str
    gateway_url: str

    def write(self) -> Path:
        path = run_file_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)
        return path

    def remove(self) -> None:
        """Delete the run file if it is still this one's (a newer `cortex up` may have replaced it)."""
        if read() == self:
            run_file_path().unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read() -> RunFile | None:
    """The run file of a `cortex up` that is still running; None if there is none."""
    try:
        found = RunFile(**json.loads(run_file_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return found if _alive(found.pid) else None


def settings_for_cli() -> GatewaySettings:
    """The settings a CLI verb uses, with the local stack's Redis when none was named; tells stderr
    which Redis it reads and why."""
    settings = GatewaySettings()
    if "redis_url" in settings.model_fields_set:
        where = (
            "from CORTEX_REDIS_URL"
            if os.environ.get("CORTEX_REDIS_URL")
            else "from the settings file"
        )
    elif (stack := read()) is not None:
        settings = settings.model_copy(update={"redis_url": stack.redis_url})
        where = f"the local stack of `cortex up` (pid {stack.pid}, {run_file_path()})"
    else:
        where = "the default: no `cortex up` is running here and CORTEX_REDIS_URL is not set"
    print(f"cortex: Redis at {redact(settings.redis_url)}, {where}", file=sys.stderr)
    return settings
