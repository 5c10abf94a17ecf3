"""Linear layers whose weights stay quantized on the device, run by torch's own weight-only
kernels: 4-bit in groups of `GROUP` along the input (`_weight_int4pack_mm_for_cpu` on a CPU,
tinygemm's `_weight_int4pack_mm` on CUDA), 8-bit integers per output channel (`_weight_int8pack_mm`)
and, on a GPU with FP8 matmuls (Hopper, Ada, Blackwell), float8 per output channel with each row of
the input rounded to float8 on the fly (`_scaled_mm`: FP8 tensor cores, both operands 8-bit).

A 4-bit group holds codes q in 0..15 and reads as `(q - 8) * scale + zero` (the kernels'
convention), so any affine group `scale * q + low` maps onto it exactly with
`zero = low + 8 * scale`. The kernels take activations, scales and zeros in bfloat16 only (on a
CPU their float32 path is scalar, 30-90x slower: docs/benchmarks.md): a layer casts its input to
bfloat16 and its output back to the input's dtype. On a CPU, a 4-bit layer's call with many rows
runs the weights dequantised a tile at a time into a float32 GEMM instead
(node_agent/model/int4_tiles.py): torch's kernel is a matrix-vector one."""

import functools

import torch
from torch.distributed.tensor import DTensor

from node_agent.model import int4_tiles, linear_shards
from shared.weight_formats import (  # GROUP: GGUF's Q4_0/Q4_1 blocks, Q4_K's sub-blocks
    GROUP,
    OUT_MULTIPLE,
)

COMPUTE_DTYPE = torch.bfloat16
# the most output channels torch's CPU int4 packing interleaves (AVX-512; 32 on AVX2)
CPU_PACK_BLOCK = 64


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15) in the layout the device's int4 kernel reads. tinygemm tiles the
    input by 16 x 8, 4 or 2 (the most that divide it: 8 is torchao's default)."""
    if codes.device.type == "cuda":
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32), 1
    )  # (tiles unused on a CPU)


def fits_int4(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernels take a layer of this shape: inputs in whole groups, outputs in whole tiles."""
    return in_features % GROUP == 0 and out_features % OUT_MULTIPLE == 0


def round_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full-precision weight [out, in] rounded to 16 levels between each group's min and max: the
    codes [out, in], scale and zero [out, in / GROUP] Int4Linear takes."""
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(weight.shape), scale, low + 8 * scale


def _channel_scale(weight: torch.Tensor, largest_code: float) -> torch.Tensor:
    """The scale [out] that puts each output channel's largest magnitude of `weight` [out, in] at `largest_code`."""
    return (weight.float().abs().amax(-1) / largest_code).clamp(min=torch.finfo(torch.float32).tiny)


def _as_output(
    y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """A kernel's [rows, out] product of `x`'s rows as the layer's output: in `x`'s dtype and leading
    dimensions, plus the bias."""
    y = y.to(x.dtype).view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def round_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision weight [out, in] rounded symmetrically per output channel: the codes [out, in]
    and scale [out] Int8Linear takes."""
    scale = _channel_scale(weight, 127)
    return (weight.float() / scale[:, None]).round().clamp(-127, 127), scale


class Int4Linear(torch.nn.Module):
    """`y = x @ W.T + b` with `W[o, i] = (q[o, i] - 8) * scale[o, i // GROUP] + zero[o, i // GROUP]`."""

    # cortex::int4_linear's arguments for this CPU once the model is bound to it (int4_tiles.bind)
    cpu_kernel: tuple[int, bool, int] | None = None

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if not fits_int4(self.out_features, self.in_features):
            raise ValueError(
                f"4-bit layers need in_features divisible by {GROUP} and out_features by {OUT_MULTIPLE}, "
                f"not {self.in_features} and {self.out_features}"
            )
        self.register_buffer("weight_packed", _pack_int4(codes))
        # [in / GROUP, out, 2]: what both kernels read
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scale.t(), zero.t()], dim=-1).to(COMPUTE_DTYPE).contiguous(),
        )
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        shard: linear_shards.Shard = linear_shards.WHOLE,
    ) -> "Int4Linear":
        """`weight` rounded whole (`round_int4`), then cut to a tensor-parallel rank's `shard` (`bias`: its own already)."""
        return cls(*shard.int4(*round_int4(weight)), bias)

    @classmethod
    def stacked(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        """One layer over the input of `layers` (see `stackable`): their packed codes, scales, zeros
        and biases joined along the outputs, so that its output is theirs side by side."""
        stack = cls.__new__(cls)
        torch.nn.Module.__init__(stack)
        stack.in_features = layers[0].in_features
        stack.out_features = sum(layer.out_features for layer in layers)
        stack.register_buffer("weight_packed", torch.cat([layer.weight_packed for layer in layers]))
        stack.register_buffer(
            "scales_and_zeros", torch.cat([layer.scales_and_zeros for layer in layers], dim=1)
        )
        biases = [layer.bias for layer in layers]
        stack.register_buffer("bias", None if biases[0] is None else torch.cat(biases))
        return stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.cpu_kernel is not None:  # the node's C++ kernel, which Inductor calls as it is
            y = int4_tiles.matmul(
                flat, self.weight_packed, self.scales_and_zeros, GROUP, self.cpu_kernel
            )
        elif torch.compiler.is_compiling():  # opaque to Inductor (compiled_step.py)
            y = int4_matmul(flat, self.weight_packed, self.scales_and_zeros, self.out_features)
        else:  # eager: the kernels themselves, without the custom operator's own dispatch
            y = _int4_matmul(flat, self.weight_packed, self.scales_and_zeros)
        return _as_output(y, x, self.out_features, self.bias)


def stackable(layers: list[torch.nn.Module]) -> bool:
    """Whether 4-bit layers over one input can be one (`Int4Linear.stacked`): plain Int4Linear layers on
    a CPU, biased alike, each with whole blocks of the CPU kernel's packing (64 output channels at
    most: a block's codes lie together, so joined packings are the packing of the joined codes)."""
    return (
        all(type(layer) is Int4Linear for layer in layers)
        and all(layer.weight_packed.device.type == "cpu" for layer in layers)
        and all(layer.out_features % CPU_PACK_BLOCK == 0 for layer in layers)
        and len({(layer.in_features, layer.bias is None) for layer in layers}) == 1
    )


def _int4_matmul(
    flat: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """`flat` [rows, in] times a 4-bit layer's packed weights: [rows, out] in COMPUTE_DTYPE, by the
    kernel for the call's rows and device."""
    if int4_tiles.runs(flat.device):  # the node's kernel on a CPU
        return int4_tiles.matmul(flat, packed, scales_and_zeros, GROUP, int4_tiles.kernel_args())
    if flat.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(
            flat.to(COMPUTE_DTYPE), packed, GROUP, scales_and_zeros
        )
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        flat.to(COMPUTE_DTYPE), packed, GROUP, scales_and_zeros
    )


@torch.library.custom_op("cortex::int4_matmul", mutates_args=())
def int4_matmul(
    flat: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int
) -> torch.Tensor:
    """A 4-bit layer's matmul as one operator that a compiled graph calls as it is: Inductor lowers
    torch's int4 kernel to a GEMM template of its own, which sums in another order (a compiled step's
    tokens would differ from an eager one's), and the kernel for a call is chosen by its rows."""
    return _int4_matmul(flat, packed, scales_and_zeros)


@int4_matmul.register_fake
def _(
    flat: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int
) -> torch.Tensor:
    return flat.new_empty((flat.shape[0], out_features), dtype=COMPUTE_DTYPE)


class ReorderedInt4Linear(Int4Linear):
    """An Int4Linear over its inputs taken in `order` (`x[..., order]`): GPTQ's activation order
    groups runs of a permutation of the inputs, which become whole groups of GROUP once the codes'
    columns (and the input) follow that permutation. The order is int32: 4 bytes an input, left out
    of placement's estimate (shared/weight_formats.py) as Int8Linear's scales are."""

    def __init__(
        self,
        order: torch.Tensor,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__(codes, scale, zero, bias)
        self.register_buffer("input_order", order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.input_order))


class Int8GroupLinear(torch.nn.Module):
    """`y = x @ W.T + b` with `W[o, i] = q[o, i] * scale[o, i // GROUP]` (q in -128..127): GGUF's
    Q8_0 code for code, where torch has no 8-bit group kernel. It runs as two 4-bit layers over the
    same input, since `q = 16 * (q >> 4) + (q & 15)`: the high nibbles (-8..7, at 16 x scale) and
    the low ones (0..15, at scale). A byte and two group scales a weight; two int4 kernel calls, about
    twice the time of one per-channel Int8Linear on a CPU (docs/benchmarks.md)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        codes = codes.to(torch.int16)
        self.out_features, self.in_features = codes.shape
        self.high = Int4Linear((codes >> 4) + 8, 16 * scale, torch.zeros_like(scale), None)
        self.low = Int4Linear(codes & 15, scale, 8 * scale, None)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.high(x) + self.low(x)
        return y if self.bias is None else y + self.bias


class Int8Linear(torch.nn.Module):
    """`y = x @ W.T + b` with `W[o, i] = q[o, i] * scale[o]` (q in -127..127)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_int8", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(COMPUTE_DTYPE))
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        shard: linear_shards.Shard = linear_shards.WHOLE,
    ) -> "Int8Linear":
        """`weight` rounded whole (`round_int8`), then cut to a tensor-parallel rank's `shard` (`bias`: its own already)."""
        return cls(*shard.int8(*round_int8(weight)), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        return _as_output(y, x, self.out_features, self.bias)


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MULTIPLE = 16  # `_scaled_mm` takes inputs and outputs in multiples of 16


def round_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision weight [out, in] scaled per output channel onto float8's range: the codes
    [out, in] (float8_e4m3fn) and scale [out] (float32) Float8Linear takes."""
    scale = _channel_scale(weight, FP8_MAX)
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _fp8_matmul_runs(device: torch.device) -> bool:
    """Whether `_scaled_mm` with a scale per row of each operand runs on this GPU (FP8 tensor cores:
    compute capability 8.9 and up, and a torch built for it): tried once on a tiny product."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    a = torch.ones(FP8_MULTIPLE, FP8_MULTIPLE, device=device).to(FP8)
    try:
        product = torch._scaled_mm(
            a,
            a.t(),
            scale_a=torch.ones(FP8_MULTIPLE, 1, device=device),
            scale_b=torch.ones(1, FP8_MULTIPLE, device=device),
            out_dtype=COMPUTE_DTYPE,
        )
    except RuntimeError:
        return False
    return bool((product == FP8_MULTIPLE).all())


def fits_fp8(weight: torch.Tensor) -> bool:
    """Whether a weight [out, in] on its device runs as Float8Linear: a GPU with FP8 matmuls and
    both sides in multiples of FP8_MULTIPLE."""
    return (
        weight.shape[0] % FP8_MULTIPLE == 0
        and weight.shape[1] % FP8_MULTIPLE == 0
        and _fp8_matmul_runs(weight.device)
    )


class Float8Linear(torch.nn.Module):
    """`y = x @ W.T + b` with `W[o, i] = q[o, i] * scale[o]` (q float8_e4m3fn), as one FP8 matmul:
    each row of x is scaled onto float8's range by its own largest magnitude (computed on the
    device, so the layer runs inside CUDA graphs), and `_scaled_mm` applies both scales to the
    float32 accumulator. A decode step runs a layer's kernels one after another at a few µs each, so
    the row scaling is written in as few kernels as eager torch allows (5 before the matmul)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_fp8", codes.to(FP8).contiguous())
        # scale / FP8_MAX: a row of x goes in as `x * FP8_MAX / largest`, and comes out times `largest`
        self.register_buffer("weight_scale", (scale.float() / FP8_MAX).reshape(1, -1).contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        shard: linear_shards.Shard = linear_shards.WHOLE,
    ) -> "Float8Linear":
        """`weight` scaled whole (`round_fp8`), then cut to a tensor-parallel rank's `shard` (`bias`: its own already)."""
        return cls(*shard.int8(*round_fp8(weight)), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        largest = torch.linalg.vector_norm(
            flat, float("inf"), dim=-1, keepdim=True, dtype=torch.float32
        )
        largest = largest.clamp_(min=torch.finfo(torch.float32).tiny)
        # at most FP8_MAX (times 1 + float32's rounding, which float8's rounding takes back to FP8_MAX)
        codes = (flat * (FP8_MAX / largest)).to(FP8)
        y = torch._scaled_mm(
            codes,
            self.weight_fp8.t(),
            scale_a=largest,
            scale_b=self.weight_scale,
            out_dtype=COMPUTE_DTYPE,
        )
        return _as_output(y, x, self.out_features, self.bias)


def eight_bit(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    shard: linear_shards.Shard = linear_shards.WHOLE,
) -> "Float8Linear | Int8Linear":
    """An 8-bit layer for `weight` on its device, a tensor-parallel rank's `shard` of it: FP8 matmuls
    where the GPU has them and the shard's sides fit (`fits_fp8`), else 8-bit integer weights (what
    `quant = "fp8"` and FP8 checkpoints run as on a CPU or an older GPU)."""
    if _fp8_matmul_runs(weight.device):
        codes, scale = shard.int8(*round_fp8(weight))
        if fits_fp8(codes):
            return Float8Linear(codes, scale, bias)
    return Int8Linear.quantize(weight, bias, shard)


QUANTIZERS = {"int4": Int4Linear.quantize, "int8": Int8Linear.quantize, "fp8": eight_bit}


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a state dict's entry (torch.ao's dynamic int8 layers keep a tuple, and a dtype;
    transformers' TP shards are DTensors, of which this rank holds its local part)."""
    if isinstance(value, DTensor):
        return [value.to_local()]
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (tuple, list)) else []


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes a model's weights hold on its device (a tensor-parallel rank's own part): everything
    in its state dict (packed and quantized layers' buffers too; a tied weight counted once)."""
    entries = {id(value): value for value in module.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for value in entries.values() for t in _tensors(value))


def held_as(model: torch.nn.Module) -> str:
    """How a model's Linear weights are held: "int4", "int8", "fp8", a mix ("int4+int8"), or "none"
    (8-bit groups are "int8": their two 4-bit halves are one layer)."""
    halves = {
        id(half)
        for m in model.modules()
        if isinstance(m, Int8GroupLinear)
        for half in (m.high, m.low)
    }
    kinds = {"int4" for m in model.modules() if isinstance(m, Int4Linear) and id(m) not in halves}
    kinds |= {"int8" for m in model.modules() if isinstance(m, (Int8Linear, Int8GroupLinear))}
    kinds |= {"fp8" for m in model.modules() if isinstance(m, Float8Linear)}
    return "+".join(sorted(kinds)) or "none"


def quantize(model: torch.nn.Module, bits: str) -> int:
    """Replace, in place, every plain `nn.Linear` but the output head by its `bits` ("int4", "int8"
    or "fp8": `eight_bit`) quantization; returns how many. The head stays as it is (llama.cpp's k-quant mixes
    keep it at 6 bits or more; most small models tie it to the embedding), and so does a 4-bit
    layer whose shape the int4 kernels do not take (`fits_int4`). A layer transformers' TP sharded
    is quantized as this rank's shard, a row-parallel one summing its partial product over the
    ranks (node_agent/model/linear_shards.py)."""
    head = model.get_output_embeddings()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            weight, bias, rowwise = linear_shards.local(child)
            if bits == "int4" and not fits_int4(*weight.shape):
                continue
            layer = QUANTIZERS[bits](weight, bias)
            setattr(parent, name, linear_shards.RowParallel(layer) if rowwise else layer)
            count += 1
    return count
