"""`/v1/rerank`, `/rerank` (Cohere/Jina shape) and `/v1/score` (vLLM's) against a stack serving a
tiny random cross-encoder: scores equal its own logits through a sigmoid (a one-label head's
default, as sentence-transformers' CrossEncoder scores), ordered, cut at `top_n`."""

import httpx
import numpy as np
import pytest
import torch

from tests import tiny_poolers

pytestmark = pytest.mark.integration

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "The capital of France is Paris.",
    "Hello there!",
    "Write a poem about the sea and the sky",
    "1 2 3 4 5 6 7 8 9 10",
    "Tell me about transformers and attention in detail please.",
]


@pytest.fixture
def expected(pooler_dirs) -> np.ndarray:
    return torch.sigmoid(
        tiny_poolers.reference_logits(pooler_dirs["rerank"], QUERY, DOCUMENTS)
    ).numpy()


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_cohere_shaped_rerank(stack, expected, path):
    documents = [DOCUMENTS[0], *({"text": doc} for doc in DOCUMENTS[1:])]
    response = httpx.post(
        f"{stack.gateway_url}{path}",
        json={
            "model": "rerank",
            "query": QUERY,
            "documents": documents,
            "top_n": 3,
            "return_documents": True,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    order = list(np.argsort(-expected, kind="stable")[:3])
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], expected[order], atol=1e-5
    )
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    assert body["model"] == "rerank" and body["usage"]["total_tokens"] > 0


def test_rerank_without_top_n_or_documents(stack, expected):
    body = httpx.post(
        f"{stack.gateway_url}/v1/rerank",
        json={"model": "rerank", "query": QUERY, "documents": DOCUMENTS},
        timeout=60,
    ).json()
    assert len(body["results"]) == len(DOCUMENTS) and all(
        "document" not in r for r in body["results"]
    )
    scores = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], expected, atol=1e-5)


def test_vllm_score(stack, expected, pooler_dirs):
    body = httpx.post(
        f"{stack.gateway_url}/v1/score",
        json={"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS},
        timeout=60,
    ).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    pairwise = httpx.post(
        f"{stack.gateway_url}/v1/score",
        json={"model": "rerank", "text_1": [QUERY, "sea"], "text_2": DOCUMENTS[:2]},
        timeout=60,
    ).json()
    other = torch.sigmoid(
        tiny_poolers.reference_logits(pooler_dirs["rerank"], "sea", DOCUMENTS[1:2])
    ).numpy()
    np.testing.assert_allclose(
        [d["score"] for d in pairwise["data"]], [expected[0], other[0]], atol=1e-5
    )
    mismatched = httpx.post(
        f"{stack.gateway_url}/v1/score",
        json={"model": "rerank", "text_1": ["a", "b"], "text_2": ["c"]},
        timeout=60,
    )
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"


def test_rerank_on_an_embedding_model_is_refused(stack):
    response = httpx.post(
        f"{stack.gateway_url}/v1/rerank",
        json={"model": "embed", "query": QUERY, "documents": DOCUMENTS},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "embed is an embedding model: it serves /v1/embeddings, not /v1/rerank and /v1/score"
    )
