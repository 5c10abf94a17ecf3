"""LoRA adapters on a replica: every targeted projection (q, k, v, o, gate, up, down) wrapped in a
`LoraLinear` that adds each token's adapter's low-rank update to the base layer's output, for
`max_loras` device slots of up to `max_lora_rank` each (Punica's and vLLM's batched LoRA, in
plain matmuls): one decode step mixes rows of different adapters and of the base.

Slot 0 is the base (no update); slots 1..S hold adapters. A layer holds every slot's A matrices
stacked ([parts x S x r, in]) and their B matrices, scaled, side by side ([out, S x r]: each part's
rows hold that part's columns): x @ A.T gives every slot's low-rank projection, a mask keeps each
token's own slot's columns, and each part's columns @ its rows of B.T add its update. Shapes never depend on which adapters a step mixes: the slot ids are a
tensor (`LoraState.ids`) the runner writes before each forward (node_agent/model/runner.py), read
in place by the fixed-shape decode step, so it stays under CUDA graphs and the compiled CPU step.

A layer that serves several projections at once (the stacked q/k/v and gate/up of
node_agent/model/fused_layers.py) holds one part per projection: its B is block-diagonal, kept as
its blocks (a dense B over the fused width cost 3x the q/k/v update's work and 2x gate/up's).
A quantized base (node_agent/model/quantized_linear.py: 4-bit, 8-bit, float8) keeps its layers as
they are: the update is added to what its kernel gives, in full precision (the adapter's own
matrices are never quantized), as vLLM and PEFT serve adapters on quantized bases.

The adapters' files are read by node_agent/model/lora_files.py."""

import torch

from node_agent.model.fused_layers import ProjectionPart
from node_agent.model.packed_linear import PackedLinear
from node_agent.model.quantized_linear import Float8Linear, Int4Linear, Int8GroupLinear, Int8Linear

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoraState:
    """What every LoraLinear of a model reads: the slot id of each row (`row_slots`, moved with
    rows) and the ids of the forward about to run (`ids`: broadcastable to its tokens [B, T])."""

    def __init__(self, slots: int, rows: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.slots, self.rank, self.dtype, self.device = slots, rank, dtype, device
        self.row_slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.decode_ids = self.row_slots[:, None]  # one token a row, rows 0..B-1
        self.ids = self.decode_ids


class LoraLinear(torch.nn.Module):
    """`base(x)` plus, for each token, its slot's `B @ A @ x` (scaled) for each part of the output."""

    def __init__(
        self, base: torch.nn.Module, widths: list[int], in_features: int, state: LoraState
    ):
        super().__init__()
        self.base, self.widths, self.state = base, widths, state
        self.in_features, self.out_features = in_features, sum(widths)
        # the activations' dtype and device (a quantized base's buffers are codes, or packed away)
        dtype, device = state.dtype, state.device
        self.span = state.slots * state.rank  # a part's columns: every slot's rank
        columns = len(widths) * self.span
        self.register_buffer("a", torch.zeros(columns, in_features, dtype=dtype, device=device))
        # each part's rows of B hold that part's columns only (no block of zeros between parts)
        self.register_buffer(
            "b", torch.zeros(self.out_features, self.span, dtype=dtype, device=device)
        )
        self.register_buffer(  # each column's slot
            "columns", (torch.arange(columns, device=device) // state.rank % state.slots + 1)
        )
        self.rows = [sum(widths[:part]) for part in range(len(widths) + 1)]  # each part's rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        ids = self.state.ids[: x.shape[0]]
        low = (x @ self.a.T) * (ids[..., None] == self.columns).to(x.dtype)
        if len(self.widths) == 1:
            return out + low @ self.b.T
        parts = low.unflatten(-1, (len(self.widths), self.span))
        update = [
            parts[..., part, :] @ self.b[self.rows[part] : self.rows[part + 1]].T
            for part in range(len(self.widths))
        ]
        return out + torch.cat(update, dim=-1)

    def place(self, part: int, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot`'s matrices for part `part` (`b` already scaled); None: no update there."""
        rank = self.state.rank
        first = part * self.span + (slot - 1) * rank  # its columns of A's rows
        column = (slot - 1) * rank  # and of its part's rows of B
        rows = slice(self.rows[part], self.rows[part + 1])
        self.a[first : first + rank].zero_()
        self.b[rows, column : column + rank].zero_()
        if a is not None:
            self.a[first : first + a.shape[0]] = a.to(self.a.dtype)
            self.b[rows, column : column + a.shape[0]] = b.to(self.b.dtype)


SERVED = (  # the projections adapters wrap
    torch.nn.Linear,
    torch.ao.nn.quantized.dynamic.Linear,  # a CPU's int8 (node_agent/model/loader.py)
    PackedLinear,
    ProjectionPart,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    Float8Linear,
)


def why_not(model: torch.nn.Module) -> str | None:
    """Why adapters cannot be served on this model (None: they can)."""
    for module in model.modules():
        for name in ATTENTION + MLP:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Module) and not isinstance(child, (*SERVED, LoraLinear)):
                return (
                    f"its {name} is a {type(child).__name__}, which adapters are not served on"
                    f" (only {', '.join(t.__name__ for t in SERVED)})"
                )
    return None


def _wrap(parent: torch.nn.Module, name: str, widths: list[int], state: LoraState) -> LoraLinear:
    base = getattr(parent, name)
    if isinstance(base, LoraLinear):  # another runner's over the same model (tests): this one's now
        base = base.base
    layer = LoraLinear(base, widths, base.in_features, state)
    setattr(parent, name, layer)
    return layer


def install(
    model: torch.nn.Module, slots: int, rows: int, rank: int
) -> tuple[LoraState, dict[str, tuple[LoraLinear, int]]]:
    """Wrap, in place, every targeted projection of `model`'s decoder layers; returns the shared
    state and, by each projection's module path as PEFT names it (`model.layers.0.self_attn.q_proj`),
    the layer that serves it and its part there."""
    embeddings = model.get_input_embeddings().weight
    state = LoraState(slots, rows, rank, embeddings.dtype, embeddings.device)
    targets = {}
    for path, module in list(model.named_modules()):
        stack = getattr(module, "qkv_proj", None)  # fused_layers.StackedProjections
        if stack is not None:
            layer = _wrap(stack, "stacked", stack.widths, state)
            for part, name in enumerate(ATTENTION[:3]):
                targets[f"{path}.{name}"] = layer, part
        gate_up = getattr(module, "gate_up", None)  # fused_layers.FusedMLP
        if gate_up is not None:
            layer = _wrap(module, "gate_up", [module.width, module.width], state)
            for part, name in enumerate(MLP[:2]):
                targets[f"{path}.{name}"] = layer, part
        for name in ATTENTION + MLP:
            child = getattr(module, name, None)
            if f"{path}.{name}" in targets or not isinstance(child, (*SERVED, LoraLinear)):
                continue
            targets[f"{path}.{name}"] = _wrap(module, name, [child.out_features], state), 0
    return state, targets
