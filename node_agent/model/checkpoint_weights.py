"""The tensors of one Linear layer of an AWQ, GPTQ or FP8 safetensors checkpoint, as what the model
holds: a quantized layer (node_agent/model/quantized_linear.py) or the dequantised weight.

- AWQ and GPTQ keep 4-bit codes q with a zero z and a scale s per group of inputs:
  `W[o, i] = (q - z) * s`. That is Int4Linear's `(q - 8) * s + zero` with `zero = (8 - z) * s`,
  so wherever each run of GROUP (32) inputs falls in one group (groups of 32, 64, 128, or a whole
  row) a layer loads code for code, with only its scales and zeros rounded to bfloat16. A GPTQ
  layer quantized in activation order (`desc_act`, its `g_idx` not sorted) groups runs of a
  permutation of the inputs: it loads code for code with its columns sorted by group, and
  gathers its input in that order (ReorderedInt4Linear). Groups that stay mixed within 32
  inputs (a group size that is no multiple of 32) are dequantised and rounded to 4-bit groups
  of 32 again.
- FP8 (float8_e4m3fn times a scale per tensor, output channel or block) is dequantised and scaled
  per output channel again (`quantized_linear.eight_bit`): float8 codes for FP8 matmuls on a GPU
  that has them (a per-tensor or per-channel checkpoint's codes come back as stored, up to a
  channel's rescaling), else Int8Linear's 8-bit integers."""

from typing import NamedTuple

import torch

from node_agent.model.linear_shards import Shard
from node_agent.model.quantized_linear import Int4Linear, ReorderedInt4Linear, fits_int4
from shared.weight_formats import GROUP, OUT_MULTIPLE

_AWQ_COLUMNS = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ packs outputs 0,2,4,6,1,3,5,7 into nibbles 0..7


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] as their eight 4-bit codes [..., n, 8], lowest nibble first: read as
    (little-endian) bytes, so that no temporary is wider than the codes."""
    data = (
        packed.to(torch.int32).contiguous().view(torch.uint8)
    )  # [..., 4n]: nibbles 2k and 2k + 1 in byte k
    return torch.stack([data & 0xF, data >> 4], dim=-1).view(*packed.shape, 8)


class FourBit(NamedTuple):
    """A 4-bit Linear weight as AWQ and GPTQ keep it: `W[o, i] = (codes[o, i] - zeros[g, o]) * scales[g, o]`
    with `g = group[i]`."""

    codes: torch.Tensor  # [out, in], 0..15
    zeros: torch.Tensor  # [groups, out]
    scales: torch.Tensor  # [groups, out]
    group: torch.Tensor  # [in]: the group of each input

    def dequantised(self) -> torch.Tensor:
        """W [out, in] in float32."""
        return (self.codes.float() - self.zeros[self.group].t()) * self.scales[self.group].t()

    def shard(self, part: Shard) -> "FourBit":
        """A tensor-parallel rank's part: its output rows, or its inputs cut on runs of GROUP (a
        checkpoint's larger group then keeps its scale and zero on both sides of the cut)."""
        rows, columns = (
            part.outputs(self.codes.shape[0], OUT_MULTIPLE),
            part.inputs(self.codes.shape[1], GROUP),
        )
        return FourBit(
            self.codes[rows, columns],
            self.zeros[:, rows],
            self.scales[:, rows],
            self.group[columns],
        )

    def layer(self, bias: torch.Tensor | None, device: torch.device) -> Int4Linear | None:
        """The Int4Linear that runs it on `device`: code for code where every GROUP inputs share a
        group, or do once the inputs are sorted by group (GPTQ's activation order: a
        ReorderedInt4Linear), else its dequantised weight rounded to groups of GROUP; None where
        the inputs do not fall into whole groups of GROUP (the layer stays dense)."""
        if not fits_int4(*self.codes.shape):
            return None
        if _whole_runs(self.group):
            return Int4Linear(*self._on(device), bias)
        order = torch.argsort(self.group, stable=True)
        if _whole_runs(self.group[order]):
            reordered = FourBit(self.codes[:, order], self.zeros, self.scales, self.group[order])
            return ReorderedInt4Linear(
                order.to(torch.int32).to(device), *reordered._on(device), bias
            )
        return Int4Linear.quantize(self.dequantised().to(device), bias)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Int4Linear's codes, scale and zero, on `device`, of a weight whose every GROUP inputs share a group."""
        first = self.group.view(-1, GROUP)[:, 0]
        scale, zero = self.scales[first].t(), self.zeros[first].t()  # [out, in / GROUP]
        return self.codes.contiguous().to(device), scale.to(device), ((8 - zero) * scale).to(device)


def _whole_runs(group: torch.Tensor) -> bool:
    """Whether each run of GROUP inputs falls in one group."""
    runs = group.view(-1, GROUP)
    return bool((runs == runs[:, :1]).all())


def _groups(inputs: int, group_size: int) -> torch.Tensor:
    """The group of each input in groups of `group_size` (-1: the whole row)."""
    return torch.arange(inputs) // (inputs if group_size == -1 else group_size)


def awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> FourBit:
    """AutoAWQ's GEMM layout: qweight [in, out / 8] and qzeros [in / group, out / 8], each word eight
    outputs in AWQ's order; scales [in / group, out]."""
    codes = _nibbles(qweight)[..., _AWQ_COLUMNS].flatten(1)  # [in, out]
    zeros = _nibbles(qzeros)[..., _AWQ_COLUMNS].flatten(1).float()
    return FourBit(
        codes.t().contiguous(), zeros, scales.float(), _groups(codes.shape[0], group_size)
    )


def gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
) -> FourBit:
    """GPTQ's layout: qweight [in / 8, out], each word eight consecutive inputs; qzeros
    [groups, out / 8], each word eight consecutive outputs, stored as z - `zero_offset` (1 in the
    original format, "gptq"; 0 in GPTQModel's "gptq_v2"); scales [groups, out]; g_idx [in]."""
    codes = _nibbles(qweight.t()).flatten(1)  # [out, in]
    zeros = _nibbles(qzeros).flatten(1).float() + zero_offset
    group = _groups(codes.shape[1], group_size) if g_idx is None else g_idx.long()
    return FourBit(codes.contiguous(), zeros, scales.float(), group)


def fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """W [out, in] in float32 from float8 codes [out, in] and their scale: one [] or [1], one per
    output channel [out] or [out, 1], or one per block of `block` rows x columns
    [ceil(out / rows), ceil(in / columns)] (a block that the scale's shape implies where None)."""
    rows, columns = weight.shape
    scale = scale.float().reshape(-1, 1) if scale.dim() < 2 else scale.float()
    if block is None:
        block = (-(-rows // scale.shape[0]), -(-columns // scale.shape[1]))
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return weight.float() * full
