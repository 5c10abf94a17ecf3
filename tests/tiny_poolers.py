"""Tiny random-weight embedding and rerank models built at test time, saved as sentence-transformers
saves them: a BERT encoder (mean or CLS pooling), a Qwen3 decoder used as an embedder (last-token
pooling), and a BERT cross-encoder (a one-label classification head). BERT ones get a WordPiece
tokenizer trained here on a small corpus. `reference_vectors` and `reference_scores` compute what such
a model should answer with transformers alone, one input at a time (no padding, no batching)."""

import json
from pathlib import Path

import torch
from tokenizers import BertWordPieceTokenizer
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertTokenizerFast,
)

from tests.tiny_models import CORPUS, make_tokenizer

_BERT = dict(
    model_type="bert",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.2,
)
_QWEN3 = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.2,
)


def wordpiece_tokenizer(folder: Path) -> BertTokenizerFast:
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(CORPUS * 20, vocab_size=200, min_frequency=1)
    folder.mkdir(parents=True, exist_ok=True)
    trainer.save_model(str(folder))
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def _sentence_transformers_files(
    folder: Path, pooling: str, normalize: bool, dimension: int
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        f"pooling_mode_{mode}": mode == pooling
        for mode in ("mean_tokens", "cls_token", "lasttoken", "max_tokens")
    }
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": dimension} | modes)
    )


def build_embedder(
    folder: Path,
    pooling: str = "mean_tokens",
    normalize: bool = True,
    decoder: bool = False,
    seed: int = 0,
    layers: int = 2,
) -> Path:
    """A random encoder (BERT) or decoder (Qwen3) of `layers` layers with sentence-transformers' pooling files."""
    folder.mkdir(parents=True, exist_ok=True)
    if decoder:
        tokenizer = make_tokenizer()
        spec = _QWEN3 | dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            architectures=["Qwen3ForCausalLM"],
        )
    else:
        tokenizer = wordpiece_tokenizer(folder)
        spec = _BERT | dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec | {"num_hidden_layers": layers})
    torch.manual_seed(seed)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(folder)
    if decoder:  # as Qwen3-Embedding's config says: a causal LM used for its hidden states
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(
            json.dumps(saved | {"architectures": ["Qwen3ForCausalLM"]})
        )
    tokenizer.save_pretrained(folder)
    _sentence_transformers_files(folder, pooling, normalize, config.hidden_size)
    return folder


def build_cross_encoder(folder: Path, seed: int = 0, activation: str | None = None) -> Path:
    """A random BERT with a one-label classification head over (query, document) pairs; `activation`:
    the score function its config names for sentence-transformers (None: its default, a sigmoid)."""
    tokenizer = wordpiece_tokenizer(folder)
    named = {"sentence_transformers": {"activation_fn": activation}} if activation else {}
    config = AutoConfig.for_model(
        **_BERT,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
        **named,
    )
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


@torch.inference_mode()
def reference_vectors(
    folder: Path, texts: list[str], mode: str = "mean", normalize: bool = True
) -> torch.Tensor:
    """Each text's vector: its token states pooled by `mode` (mean, cls, last), unit length when `normalize`."""
    tokenizer, model = (
        AutoTokenizer.from_pretrained(folder),
        AutoModel.from_pretrained(folder).eval(),
    )
    rows = []
    for text in texts:
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        vector = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[mode]
        rows.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(rows)


@torch.inference_mode()
def reference_logits(folder: Path, query: str, documents: list[str]) -> torch.Tensor:
    """The cross-encoder's logit for each (query, document) pair."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    return torch.tensor(
        [
            model(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0].item()
            for doc in documents
        ]
    )
