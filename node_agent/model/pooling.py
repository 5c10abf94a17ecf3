"""Embedding and rerank models on their device thread: loaded as sentence-transformers describes
them, run over padded batches of same-length-ish inputs.

An embedding model is a folder with a `modules.json` (sentence-transformers): its Pooling module's
`config.json` says how token states become one vector (mean, CLS or last token: decoder models
used as embedders, Qwen3-Embedding style), a Normalize module that vectors are unit length, and
`sentence_bert_config.json` the longest input it was trained on. A folder without one pools by
mean (encoders) or last token (decoders), unnormalised, as sentence-transformers does. A rerank
model is a cross-encoder: a sequence-classification head with one label over query + document,
its logit passed through the activation its config names (a sigmoid unless it says otherwise, as
sentence-transformers' CrossEncoder, vLLM and TEI score)."""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from node_agent.model import devices
from node_agent.model.loader import own_context
from node_agent.model.text_encoder import TextEncoder
from shared.catalog import ModelProfile
from shared.model_files import ModelLoadError, locate

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
}

PoolingMode = Literal["mean", "cls", "lasttoken"]


@dataclass(frozen=True)
class Pooling:
    mode: PoolingMode
    normalize: bool


@dataclass
class LoadedPooler:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    max_len: int  # the longest input, in tokens
    pooling: Pooling | None  # None: a rerank model (its head scores each pair)
    pad_id: int
    sigmoid: bool = (
        False  # a rerank model's scores are its logit through a sigmoid (else the logit itself)
    )
    encoder: TextEncoder = field(init=False)  # texts to ids through the tokenizer's backend

    def __post_init__(self):
        self.encoder = TextEncoder(self.tokenizer, self.max_len)


def read_pooling(folder: Path, is_decoder: bool) -> Pooling:
    """The Pooling and Normalize modules of `folder`'s modules.json."""
    default: PoolingMode = "lasttoken" if is_decoder else "mean"
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return Pooling(default, normalize=False)
    modules = json.loads(modules_file.read_text())
    kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    mode = default
    if "Pooling" in kinds:
        config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
        chosen = [name for key, name in _MODES.items() if config.get(key)]
        others = [
            key
            for key, on in config.items()
            if key.startswith("pooling_mode_") and on and key not in _MODES
        ]
        if others or len(chosen) != 1:
            raise ModelLoadError(
                f"{folder}: pooling {chosen + others} is not served (one of mean, CLS, last token)"
            )
        mode = chosen[0]
    return Pooling(mode, normalize="Normalize" in kinds)


def _activation(config) -> str:
    """A cross-encoder's score function as sentence-transformers reads it from the config
    (`sentence_transformers.activation_fn`, else `sbert_ce_default_activation_function`): the last
    part of its class name; a one-label head defaults to Sigmoid."""
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or getattr(
        config, "sbert_ce_default_activation_function", None
    )
    return named.rsplit(".", 1)[-1] if named else "Sigmoid"


def _trained_length(folder: Path) -> int | None:
    config = folder / "sentence_bert_config.json"
    return json.loads(config.read_text()).get("max_seq_length") if config.exists() else None


def load(profile: ModelProfile, device: str, hf_cache: str | None = None) -> LoadedPooler:
    """On the device thread: the model, its tokenizer and how it pools (`profile.kind`: embedding or rerank)."""
    files = locate(profile, hf_cache)
    if files.gguf_file:
        raise ModelLoadError(
            f"{profile.id}: embedding and rerank models load from safetensors, not GGUF"
        )
    config = AutoConfig.from_pretrained(files.folder)
    is_decoder = any(name.endswith("ForCausalLM") for name in config.architectures or [])
    dtype = _DTYPES.get(profile.dtype) or devices.default_dtype(
        device
    )  # "auto": as generation models run
    log.info(
        "loading %s (%s) from %s as %s on %s", profile.id, profile.kind, files.folder, dtype, device
    )
    if profile.kind == "rerank":
        model = AutoModelForSequenceClassification.from_pretrained(files.folder, dtype=dtype)
        if model.config.num_labels != 1:
            raise ModelLoadError(
                f"{profile.id}: a rerank model needs a one-label head; it has "
                f"{model.config.num_labels}"
            )
        pooling = None
        sigmoid = _activation(model.config) == "Sigmoid"
    else:
        model = AutoModel.from_pretrained(files.folder, dtype=dtype)
        pooling, sigmoid = read_pooling(files.folder, is_decoder), False
    tokenizer = AutoTokenizer.from_pretrained(files.tokenizer_folder or files.folder)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (config.pad_token_id or 0)
    )
    own = min(
        n for n in (own_context(config), _trained_length(files.folder), profile.max_model_len) if n
    )
    model = model.to(devices.torch_device(device)).eval()
    return LoadedPooler(
        model=model,
        tokenizer=tokenizer,
        device=devices.torch_device(device),
        max_len=own,
        pooling=pooling,
        pad_id=pad_id,
        sigmoid=sigmoid,
    )


def _pool(
    hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, mode: PoolingMode
) -> torch.Tensor:
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":  # rows are padded on the right: a row's last token is at its length - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@torch.inference_mode()
def forward(
    loaded: LoadedPooler, rows: list[list[int]], type_ids: list[list[int]] | None
) -> torch.Tensor:
    """One forward over `rows` (token ids; `type_ids`: a pair's segments), padded on the right to the
    longest: each row's pooled vector (float32), or its score for a rerank model."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), loaded.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    inputs = {"input_ids": ids.to(loaded.device), "attention_mask": mask.to(loaded.device)}
    if type_ids is not None:
        segments = torch.zeros_like(ids)
        for i, row in enumerate(type_ids):
            segments[i, : len(row)] = torch.tensor(row)
        inputs["token_type_ids"] = segments.to(loaded.device)
    out = loaded.model(**inputs)
    if loaded.pooling is None:
        scores = out.logits[:, 0].float()
        return torch.sigmoid(scores) if loaded.sigmoid else scores
    lengths = inputs["attention_mask"].sum(1)
    return _pool(
        out.last_hidden_state, inputs["attention_mask"], lengths, loaded.pooling.mode
    ).float()


def finish(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Pooled vectors as the model's last modules leave them: the leading `dimensions` when asked
    (Matryoshka), unit length when the model normalises."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


def memory_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
