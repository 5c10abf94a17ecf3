"""A whole Cortex serving a tiny random model (fast; greedy output is gibberish but
deterministic), with a batch worker: redis-server, gateway, node, `python -m gateway.batch`."""

import json
from collections.abc import Iterator

import pytest

from tests.stack import Stack, start_stack

MODEL = "tiny"


def models_toml(folder) -> str:
    return (
        f'[[models]]\nid = "{MODEL}"\nsource = "{folder}"\ndtype = "float32"\nslots = 8\n'
        f"max_model_len = 256\n"
    )


@pytest.fixture(scope="module")
def batch_stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    stack = start_stack(
        tmp_path_factory.mktemp("batch"),
        models_toml(tiny_dirs["llama"]),
        CORTEX_BATCH_LEASE_S="2",
        CORTEX_BATCH_RESUME_EVERY_S="1",
        CORTEX_ARQ_POLL_DELAY_S="0.1",
        CORTEX_TORCH_THREADS="1",
        # a queued client's position is looked up this often: the tiny model frees a slot
        # every few tens of ms, faster than the default 0.25 s would show
        CORTEX_QUEUE_POSITION_POLL_S="0.02",
    )
    try:
        stack.start_gateway()
        stack.start_node("node-a", [MODEL])
        stack.worker = stack.start_batch_worker()
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(batch_stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"{batch_stack.gateway_url}/v1", api_key="unused", max_retries=0)


def chat_line(custom_id: str, prompt: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        | body,
    }


def jsonl(lines: list) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )
