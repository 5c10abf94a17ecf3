"""Pooling results -> the embeddings, rerank and score response objects."""

import base64
import time

import numpy as np

from gateway.dialects.gather import Embedded, Scored
from gateway.dialects.protocol.embeddings import CreateEmbeddingResponse, Embedding, Usage
from gateway.dialects.protocol.rerank import (
    RerankDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    ScoreUsage,
)


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its float32 little-endian bytes."""
    return (
        base64.b64encode(vector.tobytes()).decode()
        if encoding_format == "base64"
        else vector.tolist()
    )


def embedding_response(
    model: str, embedded: Embedded, encoding_format: str
) -> CreateEmbeddingResponse:
    data = [
        Embedding(embedding=_encoded(vector, encoding_format), index=i)
        for i, vector in enumerate(embedded.vectors)
    ]
    tokens = embedded.prompt_tokens
    return CreateEmbeddingResponse(
        data=data, model=model, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)
    )


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
