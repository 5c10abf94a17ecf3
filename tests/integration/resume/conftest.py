"""Two gateway replicas (real uvicorn), one node agent serving a tiny random model with a 4096-token
context (long enough jobs to drop, resume, kill and cancel in the middle of), a real redis-server;
event logs kept 3 s, a dropped stream's job kept 3 s."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiny_models
from tests.stack import Stack, checked, start_stack

RETENTION_S = 3
GRACE_S = 3


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_models.build(
        "llama", tmp_path_factory.mktemp("long-tiny"), smol_tokenizer, max_position_embeddings=4096
    )


@pytest.fixture(scope="module")
def resume_stack(tmp_path_factory, long_tiny) -> Iterator[Stack]:
    toml = f"""
[[models]]
id = "tiny"
source = "{long_tiny}"
dtype = "float32"
slots = 4
max_model_len = 4096
"""
    stack = start_stack(
        tmp_path_factory.mktemp("resume"),
        toml,
        CORTEX_STREAM_RETENTION_S=str(RETENTION_S),
        CORTEX_DISCONNECT_GRACE_S=str(GRACE_S),
        CORTEX_JANITOR_INTERVAL_S="0.5",
        CORTEX_HEARTBEAT_S="0.5",
        CORTEX_TORCH_THREADS="1",
    )
    try:
        stack.start_gateways(2)
        stack.start_node("node-r", ["tiny"])
        yield stack
    finally:
        stack.stop()


stack = checked("resume_stack", timeout_s=15)
