"""Linear layers whose weights oneDNN has reordered once, at load, into its blocked layout for a
CPU's vector units (what Inductor's freezing does to a compiled model, and vLLM-CPU's own GEMM).
A decode step's matmuls have a few rows each; oneDNN's kernels over packed weights ran the
default model's step 28-34% faster than the plain `F.linear` at 8 and 32 rows on a 2-core EPYC
(docs/benchmarks.md). Results equal the plain layer's within float rounding."""

import torch

ROWS_HINT = 32  # the rows oneDNN tunes its packing for: a decode batch
_LINEAR = (
    torch.ops.mkldnn._linear_pointwise.default
)  # the overload itself: no lookup by arguments at each call


class PackedLinear(torch.nn.Module):
    """`y = x @ W.T + b` over the packed `W` ([out, in], opaque to everything but oneDNN)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # opaque to Inductor (node_agent/model/compiled_step.py)
            out = packed_linear(flat, self.weight, self.bias, self.out_features)
        else:  # eager: the ATen call itself, without the custom operator's own dispatch
            out = _LINEAR(flat, self.weight, self.bias, "none", [None], "")
        return out.view(*x.shape[:-1], self.out_features)


@torch.library.custom_op("cortex::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """oneDNN's matmul over a packed weight as one operator that a compiled graph calls as it is:
    Inductor lowers `mkldnn._linear_pointwise` only over weights it packed itself."""
    return _LINEAR(x, weight, bias, "none", [None], "")


@packed_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def packable(model: torch.nn.Module) -> str | None:
    """Why the model's Linear layers cannot be packed (None: they can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packs float32 and bfloat16 weights, not {dtype}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN packs bfloat16 weights only on a CPU with AVX-512 or AVX-NE-CONVERT"
    return None


def pack(model: torch.nn.Module) -> int:
    """Replace, in place, every plain `nn.Linear` of a CPU model by a `PackedLinear`; returns how
    many. A weight tied to an embedding (the output head of most small models) is packed as a
    copy: the embedding keeps its own."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
