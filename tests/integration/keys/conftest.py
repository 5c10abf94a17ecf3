"""A whole Cortex with API keys: redis-server, two gateway replicas, one node serving a tiny random
model, a batch worker; keys made with the real `cortex keys` CLI."""

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.integration.batch.conftest import models_toml
from tests.stack import Stack, start_stack

ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def keys_stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    stack = start_stack(
        tmp_path_factory.mktemp("keys"),
        models_toml(tiny_dirs["llama"]),
        CORTEX_ADMIN_KEY=ADMIN_KEY,
        CORTEX_ARQ_POLL_DELAY_S="0.1",
        CORTEX_TORCH_THREADS="1",
    )
    try:
        stack.start_gateways(2)
        stack.start_node("node-a", ["tiny"])
        stack.start_batch_worker()
        yield stack
    finally:
        stack.stop()


def cortex_keys(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    """`cortex keys ARGS` as an operator runs it, against the stack's Redis."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def create_key(stack: Stack, name: str, *flags: str) -> str:
    done = cortex_keys(stack, "create", "--name", name, *flags)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def show_key(stack: Stack, name: str) -> dict:
    done = cortex_keys(stack, "show", name, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
