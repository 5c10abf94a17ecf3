"""A pooling model's texts as token ids through its fast tokenizer's Rust backend: one call
tokenises a request's inputs with the GIL released. transformers' call around the same backend
converts every encoding in Python (attention masks, offsets, a dict per input), holding the GIL that
the node's event loop and device thread wait for: for 2,048 short inputs 73 ms, against ~30 for the
backend's own call, whose tokenising runs without the GIL. An embedding request at the input cap
slowed the jobs of the node's other models while it was tokenised.

A backend's truncation is state it holds, and requests tokenise at once in the node's thread pool:
each setting (none, to the model's length, to it on the second of a pair) has a backend copy of its
own, configured once. A tokenizer without a Rust backend is called as transformers calls it."""

from tokenizers import Tokenizer

_SETTINGS = (None, "longest_first", "only_second")  # no truncation; an input's; a pair's second


class TextEncoder:
    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backends = (
            None
            if backend is None
            else {s: _configured(backend, max_len, s, tokenizer.truncation_side) for s in _SETTINGS}
        )
        self._type_ids = "token_type_ids" in getattr(tokenizer, "model_input_names", ())

    def texts(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """Each text's ids with the model's special tokens, cut to `max_len` where `truncate`."""
        if self._backends is None:
            return self.tokenizer(
                texts, truncation=truncate, max_length=self.max_len if truncate else None
            )["input_ids"]
        backend = self._backends["longest_first" if truncate else None]
        return [e.ids for e in backend.encode_batch(texts)]

    def pairs(
        self, queries: list[str], documents: list[str], truncate: bool
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Each (query, document) pair's ids as one input, the document cut where `truncate`, and
        their segment ids where the model takes them (else None)."""
        if self._backends is None:
            encoded = self.tokenizer(
                queries,
                documents,
                truncation="only_second" if truncate else False,
                max_length=self.max_len if truncate else None,
            )
            return encoded["input_ids"], encoded.get("token_type_ids")
        backend = self._backends["only_second" if truncate else None]
        encodings = backend.encode_batch(list(zip(queries, documents)))
        ids = [e.ids for e in encodings]
        return ids, [e.type_ids for e in encodings] if self._type_ids else None


def _configured(backend: Tokenizer, max_len: int, setting: str | None, side: str) -> Tokenizer:
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    if setting is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_len, strategy=setting, direction=side)
    return copy
