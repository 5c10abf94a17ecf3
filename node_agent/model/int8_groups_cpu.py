"""8-bit codes with a scale per group of 32 inputs (GGUF's Q8_0: `w = scale * q`) on a CPU, read a
byte a weight by the node's kernel (node_agent/model/csrc/int8_group_matmul.cpp): few rows summed
in registers straight from the codes, many rows through tiles dequantised into oneDNN's GEMM.

Most GGUF files keep the token embedding in Q8_0 and tie the output head to it; llama.cpp reads
that head as stored, where a float32 model's dense head read 4x the bytes at each decode step
(node_agent/model/gguf_loader.py: the head of a float32 model on a CPU). Results equal the
dequantised weights' product in float32 but for the order of the sums. Q8_0 Linear layers run as
two 4-bit layers (quantized_linear.Int8GroupLinear), on every device."""

import functools

import torch

from node_agent.model import cpu_kernels

BLOCK = 64  # output channels a block of the kernel's layout


@functools.cache
def runs() -> bool:
    """Whether the kernel is there (built and loaded here), with its shape for compiled steps."""
    if not cpu_kernels.load():
        return False
    torch.library.register_fake("cortex::int8_group_matmul")(
        lambda x, codes, scales, out_features: x.new_empty((x.shape[0], out_features))
    )
    return True


def fits(out_features: int) -> bool:
    """Whether a layer of `out_features` outputs is whole blocks of the kernel's layout (a narrower
    one runs as Int8GroupLinear: padding would hold up to 63 channels more)."""
    return out_features % BLOCK == 0


def blocked(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [out, in] (int8) and scales [out, in / group] as the kernel reads them: codes [blocks,
    in, 64] and float32 scales [blocks, in / group, 64], channel-inner."""
    as_blocks = lambda t: t.view(-1, BLOCK, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
    return as_blocks(codes.to(torch.int8)), as_blocks(scale.float())


class CpuInt8GroupLinear(torch.nn.Module):
    """`y = x @ W.T + b` with `W[o, i] = q[o, i] * scale[o, i // group]`, q in -128..127, on a CPU."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if not fits(self.out_features):
            raise ValueError(f"{self.out_features} outputs are not whole blocks of {BLOCK}")
        blocked_codes, blocked_scales = blocked(codes, scale)
        self.register_buffer("codes", blocked_codes)
        self.register_buffer("scales", blocked_scales)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        y = torch.ops.cortex.int8_group_matmul(flat, self.codes, self.scales, self.out_features)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
