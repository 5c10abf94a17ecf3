"""An embedding or rerank job's inputs as token ids, checked against the model (in the node's
thread pool, before anything reaches the device thread): texts are tokenised (a rerank input with
its query, as one pair), token ids must be the model's own, and an input longer than the model
takes is cut when the request asks (`truncate`) and refused otherwise. An embedding job's result is
bounded: its inputs × dimensions at most `max_floats` (`NodeSettings.max_pooled_floats`)."""

from node_agent.engine.pooler import Encoded
from node_agent.model.pooling import LoadedPooler
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.wire import PoolingRequest


def encode(loaded: LoadedPooler, request: PoolingRequest, max_floats: int = 1 << 22) -> Encoded:
    if request.kind == "rerank":
        return _pairs(loaded, request)
    _check_dimensions(loaded, request.dimensions)
    _check_result_size(loaded, request, max_floats)
    texts = [(i, text) for i, text in enumerate(request.inputs) if isinstance(text, str)]
    rows: list[list[int]] = [[] for _ in request.inputs]
    if texts:
        tokenized = loaded.encoder.texts([text for _, text in texts], request.truncate)
        for (i, _), ids in zip(texts, tokenized):
            rows[i] = ids
    vocab = len(loaded.tokenizer)
    for i, given in enumerate(request.inputs):
        if isinstance(given, list):
            ids = _checked_ids(given, vocab, i)
            rows[i] = ids[: loaded.max_len] if request.truncate else ids
        _check_length(len(rows[i]), loaded.max_len, i)
    return Encoded(rows)


def _pairs(loaded: LoadedPooler, request: PoolingRequest) -> Encoded:
    if len(request.queries) != len(request.inputs):
        raise InvalidRequest(
            f"{len(request.queries)} queries for {len(request.inputs)} documents", param="query"
        )
    ids, type_ids = loaded.encoder.pairs(request.queries, list(request.inputs), request.truncate)
    for i, row in enumerate(ids):
        _check_length(len(row), loaded.max_len, i, "documents")
    return Encoded(ids, type_ids)


def _checked_ids(ids: list[int], vocab: int, index: int) -> list[int]:
    if not ids:
        raise InvalidRequest(f"input {index} is an empty list of token ids", param="input")
    if not all(0 <= token < vocab for token in ids):
        raise InvalidRequest(
            f"input {index} holds token ids outside this model's vocabulary of {vocab} (token ids "
            "must be the model's own; a client tokenising with tiktoken should send text instead)",
            param="input",
        )
    return ids


def _check_length(tokens: int, max_len: int, index: int, param: str = "input") -> None:
    if tokens == 0:
        raise InvalidRequest(f"input {index} has no tokens for this model", param=param)
    if tokens > max_len:
        raise ContextLengthExceeded(
            f"input {index} has {tokens} tokens; this model takes at most {max_len}. Shorten "
            "it, or ask for truncation",
            param=param,
        )


def _check_result_size(loaded: LoadedPooler, request: PoolingRequest, max_floats: int) -> None:
    dimensions = request.dimensions or loaded.model.config.hidden_size
    if len(request.inputs) * dimensions > max_floats:
        raise InvalidRequest(
            f"{len(request.inputs)} inputs × {dimensions} dimensions is more than this node returns "
            f"in one request (at most {max_floats} floats): send fewer inputs, or fewer dimensions",
            param="input",
        )


def _check_dimensions(loaded: LoadedPooler, dimensions: int | None) -> None:
    full = loaded.model.config.hidden_size
    if dimensions is not None and not 0 < dimensions <= full:
        raise InvalidRequest(
            f"dimensions must be between 1 and the model's {full}; got {dimensions}",
            param="dimensions",
        )
