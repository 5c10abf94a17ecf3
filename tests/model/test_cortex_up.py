"""What the README promises: `scripts/serve` (which is `cortex up`) and then, in another shell,
`cortex status --json`, `cortex models` and `cortex drain` with no flags: each finds the stack's
private Redis through the run file `cortex up` leaves, and says which Redis it read. The default
catalogue and the default model, as a user gets them."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.catalog import DEFAULT_MODEL_ID
from shared.processes import Child, free_port, start
from tests.conftest import wait_until

pytestmark = pytest.mark.model

UP_TIMEOUT_S = 240.0  # a first GGUF load dequantises for ~30 s on a busy 2-core machine


@pytest.fixture(scope="module")
def user_env(tmp_path_factory) -> dict[str, str]:
    """A shell with no CORTEX_* settings but the ports (31313/31379 may be taken on this machine) and
    Redis's data directory."""
    root = tmp_path_factory.mktemp("up")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORTEX_")}
    return env | {
        "CORTEX_RUN_FILE": str(root / "up.json"),
        "CORTEX_PORT": str(free_port()),
        "CORTEX_UP_REDIS_DIR": str(root / "redis"),  # not the user's own data directory
        "CORTEX_UP_REDIS_PORT": str(free_port()),
        "CORTEX_NODE_NAME": "up-node",
        "CORTEX_TORCH_THREADS": "1",
        "LOG_DIR": str(root),
    }


@pytest.fixture(scope="module")
def cortex_up(user_env) -> Iterator[Child]:
    up = start(
        "cortex up",
        [sys.executable, "-m", "gateway.cli", "up"],
        user_env,
        log_path=Path(user_env["LOG_DIR"]) / "up.log",
    )
    try:
        wait_until(
            lambda: "ready: OpenAI-compatible API" in up.log_tail(100_000),
            UP_TIMEOUT_S,
            "cortex up",
            alive=up.alive,
        )
    except (RuntimeError, TimeoutError) as exc:
        up.stop(30)
        raise RuntimeError(f"{exc}; its log ends:\n{up.log_tail()}") from None
    yield up
    up.stop(60)


def cortex(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_json_finds_the_stack_cortex_up_started(cortex_up, user_env):
    done = cortex(user_env, "status", "--json")

    assert done.returncode == 0, done.stderr
    redis_port = user_env["CORTEX_UP_REDIS_PORT"]
    assert f"redis://127.0.0.1:{redis_port}/0" in done.stderr and "`cortex up`" in done.stderr
    (node,) = json.loads(done.stdout)["nodes"]
    assert node["node"] == "up-node" and node["alive"] and node["state"] == "active"
    assert node["models"][DEFAULT_MODEL_ID]["state"] == "ready"


def test_models_and_drain_find_it_too(cortex_up, user_env):
    pinned = cortex(user_env, "models", "pin", "default")
    assert pinned.returncode == 0 and "default pinned" in pinned.stdout, pinned.stderr

    drained = cortex(user_env, "drain", "up-node")
    assert drained.returncode == 0 and "draining up-node" in drained.stdout, drained.stderr
    wait_until(
        lambda: (
            json.loads(cortex(user_env, "status", "--json").stdout)["nodes"][0]["state"] != "active"
        ),
        30,
        "the node to leave `active`",
    )


def test_stopping_cortex_up_removes_its_run_file(cortex_up, user_env):
    assert os.path.exists(user_env["CORTEX_RUN_FILE"])
    cortex_up.stop(60)
    assert not os.path.exists(user_env["CORTEX_RUN_FILE"])
    done = cortex(user_env, "status", "--json", "--redis-url", "redis://127.0.0.1:1/0")
    assert done.returncode == 2 and "cannot read Redis" in done.stderr
