"""OpenAI's embeddings wire types (`POST /v1/embeddings`), named as the spec names them, fields in
spec order. `input` is a text, a list of texts, a list of token ids, or a list of such lists (ids
are the model's own; a node refuses any outside its vocabulary). vLLM's `truncate_prompt_tokens`
is not taken: an input longer than the model takes is a 400, as OpenAI answers."""

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gateway.dialects.protocol.bounds import TokenId
from gateway.dialects.protocol.lenient import Lenient

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request

TokenIds = Annotated[list[TokenId], Field(min_length=1)]
EmbeddingInput = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
)


class EmbeddingCreateParams(Lenient):
    input: EmbeddingInput
    model: str
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a text, or one input's token ids."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class Embedding(BaseModel):
    embedding: list[float] | str  # str: base64 of the float32 little-endian values
    index: int
    object: Literal["embedding"] = "embedding"


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(BaseModel):
    data: list[Embedding]
    model: str
    object: Literal["list"] = "list"
    usage: Usage
