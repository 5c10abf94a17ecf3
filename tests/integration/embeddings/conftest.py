"""A whole Cortex serving tiny random embedding and rerank models beside a tiny chat model, with a
batch worker: redis-server, gateway, one node, `python -m gateway.batch`.

- `embed`: a BERT encoder, mean pooling + Normalize (as all-MiniLM-L6-v2), alias `embedder`
- `embed-last`: a Qwen3 decoder used as an embedder (last-token pooling + Normalize), trained for
  truncation (`matryoshka_dimensions = []`)
- `embed-slow`: a 12-layer `embed`, one input a forward pass (`pooling_batch_tokens = 16`)
- `rerank`: a BERT cross-encoder (one-label classification head)
- `chat`: a tiny Llama (the small-vocabulary tokenizer)"""

from collections.abc import Iterator

import pytest

from tests import tiny_poolers
from tests.integration.clients.conftest import openai_client  # noqa: F401 (a fixture)
from tests.stack import Stack, checked, start_stack


@pytest.fixture(scope="session")
def pooler_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("poolers")
    return {
        "embed": tiny_poolers.build_embedder(root / "embed"),
        "embed-last": tiny_poolers.build_embedder(root / "last", pooling="lasttoken", decoder=True),
        "embed-slow": tiny_poolers.build_embedder(root / "slow", layers=12),
        "rerank": tiny_poolers.build_cross_encoder(root / "rerank"),
    }


@pytest.fixture(scope="session")
def embeddings_stack(tmp_path_factory, pooler_dirs, small_vocab_dirs) -> Iterator[Stack]:
    toml = f"""
[[models]]
id = "embed"
kind = "embedding"
source = "{pooler_dirs["embed"]}"
aliases = ["embedder"]
dtype = "float32"
max_model_len = 128
pooling_pass_ms = 0  # whole passes beside the chat model: test_embeddings counts them

[[models]]
id = "embed-last"
kind = "embedding"
source = "{pooler_dirs["embed-last"]}"
dtype = "float32"
max_model_len = 128
matryoshka_dimensions = []

[[models]]
id = "embed-slow"
kind = "embedding"
source = "{pooler_dirs["embed-slow"]}"
dtype = "float32"
max_model_len = 128
pooling_batch_tokens = 16  # one input a pass: a request of many takes long enough to be left

[[models]]
id = "rerank"
kind = "rerank"
source = "{pooler_dirs["rerank"]}"
dtype = "float32"
max_model_len = 128

[[models]]
id = "chat"
source = "{small_vocab_dirs["llama"]}"
dtype = "float32"
slots = 4
max_model_len = 256
default_max_tokens = 8
"""
    stack = start_stack(
        tmp_path_factory.mktemp("embeddings"),
        toml,
        CORTEX_ARQ_POLL_DELAY_S="0.1",
        CORTEX_MAX_EVENT_BYTES="65536",  # large results go through `cortex:result:{job}`
        CORTEX_WHOLE_FLUSH_S="0.05",  # an answer not streamed comes in joined deltas, several a job
    )
    try:
        stack.start_gateway()
        stack.start_node("node-e", ["embed", "embed-last", "embed-slow", "rerank", "chat"])
        stack.start_batch_worker()
        yield stack
    finally:
        stack.stop()


stack = checked("embeddings_stack")
