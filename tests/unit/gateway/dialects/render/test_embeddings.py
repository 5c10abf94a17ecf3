"""Embedding answers as JSON (gateway/dialects/render/embeddings.py through
gateway/http/vector_json.py): each dialect's response model, every value the float32 the node
pooled, whether the vectors go as floats or base64."""

import base64
import json

import numpy as np
import pytest

from gateway.dialects.gather import Embedded
from gateway.dialects.protocol.embeddings import CreateEmbeddingResponse
from gateway.dialects.protocol.ollama import EmbedResponse
from gateway.dialects.render.embeddings import embed_response, embedding_response
from gateway.http.vector_json import VectorJSONResponse

VECTORS = [np.random.default_rng(i).standard_normal(384).astype("<f4") for i in range(5)]


def written(content: dict) -> dict:
    return json.loads(VectorJSONResponse(content).body)


def as_float32(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype("<f4")


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_embeddings_carry_each_float32_exactly(encoding_format):
    body = written(embedding_response("m", Embedded(VECTORS, 11), encoding_format))
    answer = CreateEmbeddingResponse.model_validate(body)  # the spec's shape
    assert answer.model == "m" and answer.usage.prompt_tokens == answer.usage.total_tokens == 11
    for i, (item, vector) in enumerate(zip(answer.data, VECTORS)):
        assert item.index == i and item.object == "embedding"
        got = (
            np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
            if encoding_format == "base64"
            else as_float32(item.embedding)
        )
        assert np.array_equal(got, vector)


def test_ollama_embed_carries_each_float32_exactly():
    body = written(embed_response("m", VECTORS, total_duration=7, prompt_eval_count=11))
    answer = EmbedResponse.model_validate(body)
    assert (answer.model, answer.total_duration, answer.prompt_eval_count) == ("m", 7, 11)
    assert "load_duration" not in body  # unset fields are left out, as before
    assert len(answer.embeddings) == len(VECTORS)
    for got, vector in zip(answer.embeddings, VECTORS):
        assert np.array_equal(as_float32(got), vector)
    assert written(embed_response("m", []))["embeddings"] == []
