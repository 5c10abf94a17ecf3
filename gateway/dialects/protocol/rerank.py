"""Rerank and score wire types. `POST /v1/rerank` (and `/rerank`) in the shape Cohere and Jina
share, which vLLM, TEI, LiteLLM and Open WebUI's external reranker speak: a query, documents
(texts or `{"text"}` objects), `top_n`, `return_documents`; results sorted by relevance.
`POST /v1/score` in vLLM's shape: `text_1` against each of `text_2` (or pairwise when both are
lists of one length)."""

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from gateway.dialects.protocol.embeddings import MAX_INPUTS
from gateway.dialects.protocol.lenient import Lenient


class RerankDocument(Lenient):
    text: str


Documents = Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]


class RerankRequest(Lenient):
    model: str
    query: str
    documents: Documents
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False

    @property
    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(Lenient):
    model: str
    text_1: Texts
    text_2: Texts

    @model_validator(mode="after")
    def _pairable(self) -> "ScoreRequest":
        if (
            isinstance(self.text_1, list)
            and len(self.text_1) > 1
            and (not isinstance(self.text_2, list) or len(self.text_2) != len(self.text_1))
        ):
            raise ValueError(
                "text_2: a list of text_1 pairs with a list of text_2 of the same length"
            )
        return self

    def pairs(self) -> tuple[list[str], list[str]]:
        """(queries, documents), one of each per score."""
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        queries = self.text_1 if isinstance(self.text_1, list) and len(self.text_1) > 1 else None
        first = self.text_1 if isinstance(self.text_1, str) else self.text_1[0]
        return queries or [first] * len(documents), documents


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
