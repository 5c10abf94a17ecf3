"""Pooling results -> the embeddings, rerank and score response objects."""

import base64
import time

import numpy as np

from gateway.dialects.gather import Embedded, Scored
from gateway.dialects.protocol.embeddings import CreateEmbeddingResponse, Embedding, Usage
from gateway.dialects.protocol.ollama import EmbedResponse
from gateway.dialects.protocol.rerank import (
    RerankDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    ScoreUsage,
)


def embedding_response(
    model: str, embedded: Embedded, encoding_format: str, arrays: bool = True
) -> dict:
    """OpenAI's CreateEmbeddingResponse as JSON content: each vector as floats (its float32 array
    for gateway/http/vector_json.py to write, or where not `arrays` a list, for a batch's output
    line) or base64 of its float32 little-endian bytes."""
    base64_format = encoding_format == "base64"
    data = [
        Embedding.model_construct(
            embedding=base64.b64encode(vector.tobytes()).decode() if base64_format else [],
            index=i,
        )
        for i, vector in enumerate(embedded.vectors)
    ]
    tokens = embedded.prompt_tokens
    content = CreateEmbeddingResponse.model_construct(
        data=data, model=model, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)
    ).model_dump(mode="json")
    if not base64_format:
        for item, vector in zip(content["data"], embedded.vectors):
            item["embedding"] = vector if arrays else vector.tolist()
    return content


def embed_response(model: str, vectors: list[np.ndarray], **timings: int | None) -> dict:
    """Ollama's EmbedResponse as JSON content, its vectors one float32 matrix (for
    gateway/http/vector_json.py to write)."""
    answer = EmbedResponse.model_construct(model=model, embeddings=[], **timings)
    content = answer.model_dump(mode="json", exclude_none=True)
    content["embeddings"] = np.stack(vectors) if vectors else []
    return content


def rerank_response(
    model: str, documents: list[str], scored: Scored, top_n: int | None, return_documents: bool
) -> RerankResponse:
    """Documents by relevance, most relevant first (ties in their given order), the first `top_n`."""
    ranked = sorted(range(len(documents)), key=lambda i: -scored.scores[i])[:top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scored.scores[i],
            document=RerankDocument(text=documents[i]) if return_documents else None,
        )
        for i in ranked
    ]
    return RerankResponse(
        id=f"rerank-{scored.job}",
        model=model,
        results=results,
        usage=RerankUsage(total_tokens=scored.prompt_tokens),
    )


def score_response(model: str, scored: Scored) -> ScoreResponse:
    data = [ScoreData(index=i, score=value) for i, value in enumerate(scored.scores)]
    tokens = scored.prompt_tokens
    return ScoreResponse(
        id=f"score-{scored.job}",
        created=int(time.time()),
        model=model,
        data=data,
        usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
