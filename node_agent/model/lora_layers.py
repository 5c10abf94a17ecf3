"""LoRA adapters on a replica: every targeted projection (q, k, v, o, gate, up, down) wrapped in a
`LoraLinear` that adds each token's adapter's low-rank update to the base layer's output, for
`max_loras` device slots of up to `max_lora_rank` each (Punica's and vLLM's batched LoRA): one
decode step mixes rows of different adapters and of the base.

Slot 0 is the base (no update); slots 1..S hold adapters. A layer holds each slot's A matrices
([S, parts x r, in]) and, for each part of its output, that part's B matrices transposed ([S, r,
width], scaled). Shapes never depend on which adapters a step mixes: the slot ids are a tensor
(`LoraState.ids`) the runner writes before each forward (node_agent/model/runner.py), read in place
by the fixed-shape decode step, so it stays under CUDA graphs and the compiled CPU step.

Two ways to add the updates, by device:
- on a CPU, one call a layer (`cortex::lora_update`, node_agent/model/csrc/lora_update.cpp): each
  token through its own adapter only, tokens grouped by slot so each adapter's matrices are read
  once for a few tokens (Punica's SGMV); opaque to Inductor, as the packed matmul is;
- on a GPU (or a CPU without the node's C++ kernels, or a base layer whose output is not in the
  activations' dtype): batched matmuls over every slot for every
  token, each token's result masked to its own slot: S times the work, in a few fixed-shape calls
  a CUDA graph captures.

A layer that serves several projections at once (the stacked q/k/v and gate/up of
node_agent/model/fused_layers.py) holds one part per projection: one A for all (their input is the
same), one B per part. A quantized base (node_agent/model/quantized_linear.py: 4-bit, 8-bit, float8)
keeps its layers as they are: the update is added to what its kernel gives, in full precision (the
adapter's own matrices are never quantized), as vLLM and PEFT serve adapters on quantized bases.

The adapters' files are read by node_agent/model/lora_files.py."""

import functools

import torch

from node_agent.model import cpu_kernels
from node_agent.model.fused_layers import ProjectionPart
from node_agent.model.packed_linear import PackedLinear
from node_agent.model.quantized_linear import Float8Linear, Int4Linear, Int8GroupLinear, Int8Linear

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoraState:
    """What every LoraLinear of a model reads: the slot id of each row (`row_slots`, moved with
    rows) and the ids of the forward about to run (`ids`: broadcastable to its tokens [B, T])."""

    def __init__(
        self,
        slots: int,
        rows: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: bool | None = None,
    ):
        """`kernel`: whether layers call the CPU kernel (default: on a CPU where it is built)."""
        self.slots, self.rank, self.dtype, self.device = slots, rank, dtype, device
        self.row_slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.decode_ids = self.row_slots[:, None]  # one token a row, rows 0..B-1
        self.ids = self.decode_ids
        self.adapter_slots = torch.arange(1, slots + 1, device=device)[:, None, None]
        self.kernel = (device.type == "cpu" and _kernel()) if kernel is None else kernel

    def token_slots(self, x: torch.Tensor) -> torch.Tensor:
        """The slot of each token of `x` [B, T, in], flat [B x T]."""
        return self.ids[: x.shape[0]].expand(x.shape[:-1]).reshape(-1)


@functools.cache
def _kernel() -> bool:
    """Whether `cortex::lora_update` is there (with its shape for compiled steps)."""
    if not cpu_kernels.load():
        return False
    torch.library.register_fake("cortex::lora_update")(lambda out, x, slots, a, bts, rank: None)
    return True


class LoraLinear(torch.nn.Module):
    """`base(x)` plus, for each token, its slot's `B @ A @ x` (scaled) for each part of the output."""

    def __init__(
        self, base: torch.nn.Module, widths: list[int], in_features: int, state: LoraState
    ):
        super().__init__()
        self.base, self.widths, self.state = base, widths, state
        self.in_features, self.out_features = in_features, sum(widths)
        # the activations' dtype and device (a quantized base's buffers are codes, or packed away)
        dtype, device, slots, rank = state.dtype, state.device, state.slots, state.rank
        self.register_buffer(
            "a", torch.zeros(slots, len(widths) * rank, in_features, dtype=dtype, device=device)
        )
        # each part's B (transposed), its own columns only: no blocks of zeros between parts
        for part, width in enumerate(widths):
            self.register_buffer(
                f"bt{part}", torch.zeros(slots, rank, width, dtype=dtype, device=device)
            )

    def bts(self) -> list[torch.Tensor]:
        return [getattr(self, f"bt{part}") for part in range(len(self.widths))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        slots, flat = self.state.token_slots(x), x.reshape(-1, self.in_features)
        if self.state.kernel and out.dtype == x.dtype == self.a.dtype and out.is_contiguous():
            torch.ops.cortex.lora_update(
                out.view(-1, self.out_features), flat, slots, self.a, self.bts(), self.state.rank
            )
            return out
        mine = (slots[None, :, None] == self.state.adapter_slots).to(x.dtype)  # [S, tokens, 1]
        low = torch.matmul(flat, self.a.transpose(1, 2)) * mine  # [S, tokens, parts x r]
        rank = self.state.rank
        updates = [
            torch.bmm(low[..., part * rank : (part + 1) * rank], bt)
            for part, bt in enumerate(self.bts())
        ]
        update = updates[0] if len(updates) == 1 else torch.cat(updates, dim=-1)
        return out + update.sum(0).view(out.shape)

    def place(self, part: int, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot`'s matrices for part `part` (`b` already scaled); None: no update there."""
        rank = self.state.rank
        slot_a = self.a[slot - 1, part * rank : (part + 1) * rank]
        slot_bt = self.bts()[part][slot - 1]
        slot_a.zero_()
        slot_bt.zero_()
        if a is not None:
            slot_a[: a.shape[0]] = a.to(slot_a.dtype)
            slot_bt[: a.shape[0]] = b.T.to(slot_bt.dtype)


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
