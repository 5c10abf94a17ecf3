"""A PEFT LoRA adapter's files (`adapter_config.json` + `adapter_model.safetensors`, as
`save_pretrained` writes them) read into host memory and checked against the base it is to run
on: every refusal an `AdapterLoadFailed` saying why (missing or corrupt files, another base's
shapes, a rank over `max_lora_rank`, a kind of adapter not supported). The runner copies a
`HostAdapter` into a device slot when a sequence needs it (node_agent/model/lora_layers.py)."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from node_agent.model.lora_layers import LoraLinear
from shared.errors import AdapterLoadFailed

PREFIX = "base_model.model."


@dataclass
class HostAdapter:
    name: str
    source: str  # the folder it was read from
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A, B x scaling)

    @property
    def bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(folder: Path, name: str) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterLoadFailed(f"adapter {name!r}: no adapter_config.json in {folder}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterLoadFailed(f"adapter {name!r}: adapter_config.json is unreadable ({exc})")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadFailed(
            f"adapter {name!r}: a {config.get('peft_type')} adapter; only LoRA is served"
        )
    for key, what in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
        ("fan_in_fan_out", "fan_in_fan_out"),
    ):
        if config.get(key):
            raise AdapterLoadFailed(f"adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterLoadFailed(f"adapter {name!r}: trained biases are not supported")
    return config


def read(
    name: str, folder: Path, targets: dict[str, tuple[LoraLinear, int]], max_rank: int
) -> HostAdapter:
    """Adapter `name` from `folder`, checked against the base's wrapped projections `targets`."""
    config = _config(folder, name)
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise AdapterLoadFailed(
            f"adapter {name!r}: rank {rank} is over this model's max_lora_rank ({max_rank})"
            if rank > max_rank
            else f"adapter {name!r}: rank {rank} is not a rank"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except FileNotFoundError:
        raise AdapterLoadFailed(f"adapter {name!r}: no adapter_model.safetensors in {folder}")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterLoadFailed(f"adapter {name!r}: adapter_model.safetensors is corrupt ({exc})")
    weights = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise AdapterLoadFailed(f"adapter {name!r}: {key} is not a LoRA weight served")
            continue
        path = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if path not in targets:
            raise AdapterLoadFailed(
                f"adapter {name!r} targets {path}, which this base has no projection of "
                "(an adapter of another base, or a module not served: q, k, v, o, gate, up, down)"
            )
        layer, part = targets[path]
        expected = (rank, layer.in_features), (layer.widths[part], rank)
        if b is None or (tuple(a.shape), tuple(b.shape)) != expected:
            raise AdapterLoadFailed(
                f"adapter {name!r}: {path} has shapes {tuple(a.shape)} and "
                f"{None if b is None else tuple(b.shape)}, not this base's {expected[0]} and "
                f"{expected[1]} (an adapter of another base?)"
            )
        weights[path] = a.contiguous(), (b * scaling).contiguous()
    if not weights:
        raise AdapterLoadFailed(f"adapter {name!r}: no LoRA weights in {folder}")
    return HostAdapter(name, str(folder), rank, weights)
