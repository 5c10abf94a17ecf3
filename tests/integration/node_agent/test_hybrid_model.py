"""Qwen3.5 served: a Qwen3.5-shaped tiny model (qwen3_5_text: three GatedDeltaNet linear-attention
layers and one full-attention layer) behind a real gateway and node agent, several streams at once
(more than its slots, prompts read in chunks), each greedy-equal, token for token, to plain
full-forward greedy decoding."""

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from node_agent.model import loader
from node_agent.serving import prompts
from tests.integration.fleet.conftest import catalogue
from tests.model_fixtures import tiny_profile
from tests.stack import Stack, serving
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request

pytestmark = pytest.mark.integration

MODEL = "qwen3.5-tiny"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_vocab_dirs) -> Iterator[Stack]:
    toml = catalogue(
        small_vocab_dirs["qwen3_5_text"], **{MODEL: {"slots": 4, "prefill_chunk_tokens": 16}}
    )
    with serving(tmp_path_factory.mktemp("hybrid"), toml, "n1", [MODEL]) as stack:
        yield stack


def stream_tokens(client: openai.OpenAI, content: str) -> list[str]:
    """The streamed tokens of one greedy chat completion (from their logprob entries)."""
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        stream=True,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    return [
        entry.token
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs
        for entry in choice.logprobs.content or []
    ]


def test_concurrent_streams_equal_full_forward_greedy(stack, small_vocab_dirs):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
    contents = [f"{p} {p}" for p in PROMPTS]  # 36-52 tokens: several chunks each
    with ThreadPoolExecutor(len(contents)) as pool:
        streamed = list(pool.map(lambda content: stream_tokens(client, content), contents))
    profile = tiny_profile(small_vocab_dirs["qwen3_5_text"])
    lm = loader.load(profile, "cpu")
    for content, tokens in zip(contents, streamed):
        ids = prompts.prompt_ids(lm.tokenizer, profile, request("ref", content))
        assert tokens == [
            lm.tokenizer.decode([t]) for t in full_forward_greedy(lm, ids, MAX_TOKENS)
        ], content
    stack.assert_clean()
