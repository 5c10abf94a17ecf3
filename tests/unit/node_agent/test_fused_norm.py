"""RMSNorms as one ATen call (node_agent/model/fused_norm.py): the same numbers as transformers'
Llama RMSNorm in float32 and bfloat16; norms with another forward (Gemma's 1 + weight) stay."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from node_agent.model import fused_norm


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_it_gives_llamas_numbers(dtype, weight_dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(weight_dtype)
    norm.weight.data.normal_()
    x = torch.randn(3, 5, 96).to(dtype) * 4
    got = fused_norm.FusedRMSNorm(norm)(x)
    want = norm(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_only_norms_whose_forward_is_llamas_are_replaced():
    model = torch.nn.ModuleDict({"llama": LlamaRMSNorm(8), "qwen3": Qwen3RMSNorm(8), "gemma": GemmaRMSNorm(8),
                                 "inner": torch.nn.ModuleDict({"norm": LlamaRMSNorm(8)})})
    assert fused_norm.fuse(model) == 3
    assert isinstance(model["llama"], fused_norm.FusedRMSNorm) and isinstance(model["qwen3"], fused_norm.FusedRMSNorm)
    assert isinstance(model["inner"]["norm"], fused_norm.FusedRMSNorm)
    assert type(model["gemma"]) is GemmaRMSNorm
