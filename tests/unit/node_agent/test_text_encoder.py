"""A pooling model's texts through its tokenizer's Rust backend (node_agent/model/text_encoder.py)
give the ids transformers' call gives, cut alike, with or without truncation, for inputs and for a
rerank model's (query, document) pairs, whichever setting ran before on another thread."""

import threading

import pytest
from transformers import AutoTokenizer

from node_agent.model.text_encoder import TextEncoder
from tests import tiny_poolers

MAX_LEN = 24
TEXTS = ["Hello there!", "sea", "Tell me about attention in detail please. " * 6, "1 2 3"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {
        "embedder": AutoTokenizer.from_pretrained(tiny_poolers.build_embedder(root / "e")),
        "decoder": AutoTokenizer.from_pretrained(
            tiny_poolers.build_embedder(root / "d", pooling="lasttoken", decoder=True)
        ),
        "cross-encoder": AutoTokenizer.from_pretrained(
            tiny_poolers.build_cross_encoder(root / "r")
        ),
    }


class WithoutBackend:
    """A tokenizer with no Rust backend (transformers' Python ones): called as transformers calls it."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.model_input_names = tokenizer.model_input_names

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


@pytest.mark.parametrize("backend", [True, False], ids=["rust", "python"])
@pytest.mark.parametrize("model", ["embedder", "decoder", "cross-encoder"])
@pytest.mark.parametrize("truncate", [False, True])
def test_texts_read_as_transformers_reads_them(tokenizers, model, truncate, backend):
    tokenizer = tokenizers[model]
    encoder = TextEncoder(tokenizer if backend else WithoutBackend(tokenizer), MAX_LEN)
    assert (
        encoder.texts(TEXTS, truncate)
        == tokenizer(TEXTS, truncation=truncate, max_length=MAX_LEN if truncate else None)[
            "input_ids"
        ]
    )
    longest = max(len(ids) for ids in encoder.texts(TEXTS, truncate))
    assert (longest <= MAX_LEN) == truncate  # the long text is cut only when asked


@pytest.mark.parametrize("backend", [True, False], ids=["rust", "python"])
@pytest.mark.parametrize("truncate", [False, True])
def test_pairs_read_as_transformers_reads_them(tokenizers, truncate, backend):
    tokenizer = tokenizers["cross-encoder"]
    queries = ["what is the sea?"] * len(TEXTS)
    encoder = TextEncoder(tokenizer if backend else WithoutBackend(tokenizer), MAX_LEN)
    ids, type_ids = encoder.pairs(queries, TEXTS, truncate)
    expected = tokenizer(
        queries,
        TEXTS,
        truncation="only_second" if truncate else False,
        max_length=MAX_LEN if truncate else None,
    )
    assert ids == expected["input_ids"]
    assert type_ids == expected.get("token_type_ids")


def test_settings_do_not_leak_between_threads(tokenizers):
    """Truncated and whole requests at once: each backend copy keeps its own setting."""
    encoder = TextEncoder(tokenizers["embedder"], MAX_LEN)
    whole, cut = encoder.texts(TEXTS, False), encoder.texts(TEXTS, True)
    wrong = []

    def tokenise(truncate: bool) -> None:
        for _ in range(200):
            if encoder.texts(TEXTS, truncate) != (cut if truncate else whole):
                wrong.append(truncate)

    threads = [threading.Thread(target=tokenise, args=(t,)) for t in (False, True, False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and whole != cut
