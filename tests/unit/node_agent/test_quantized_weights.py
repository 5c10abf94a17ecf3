"""Quantized weights (node_agent/model/quantized_linear.py, gguf_loader.py): GGUF files written
here load with their Linear weights quantized, Q4_0/Q4_1/Q4_K code for code (their logits equal
the dequantised model's within the bfloat16 rounding of the kernels' activations), Q8_0 code for
code as 8-bit groups (the same), Q6_K per channel and Q5_K requantized (within stated bounds); the engine runs them as HF runs them; and a
load holds about the quantized size, never the full-precision model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from node_agent.engine.engine import Engine
from node_agent.model import int4_tiles, int8_groups_cpu, loader, quantized_linear
from node_agent.model.int8_groups_cpu import BLOCK, CpuInt8GroupLinear
from node_agent.model.quantized_linear import Float8Linear, Int4Linear, Int8GroupLinear, Int8Linear
from node_agent.serving import prompts
from shared import memory
from shared.catalog import Catalog
from tests import gguf_files, tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run

# Largest |logit difference| / largest |logit| against the dequantised model, per stored type
# (measured on these models: Q4_0 0.009, Q4_1 0.013, Q4_K 0.002, Q8_0 0.010, Q6_K 0.027, Q5_K 0.005;
# Q8_0 rounded per channel to int8, as before 8-bit groups: 0.031).
EXACT = {
    T.Q4_0: 0.02,
    T.Q4_1: 0.02,
    T.Q4_K: 0.02,
    T.Q8_0: 0.02,
}  # bfloat16 activations and scales only
REQUANTIZED = {T.Q6_K: 0.05, T.Q5_K: 0.02}  # + rounded per channel to int8, or to int4 groups
LAYOUT = {
    T.Q4_0: Int4Linear,
    T.Q4_1: Int4Linear,
    T.Q4_K: Int4Linear,
    T.Q5_K: Int4Linear,
    T.Q8_0: Int8GroupLinear,
    T.Q6_K: Int8Linear,
}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """(arch, type) -> the profile of a GGUF file of a tiny model, its tokenizer from its HF folder.
    Rows of 256 inputs (a k-quant super-block); the qwen3 one has Qwen3's head_dim of 128:
    transformers reads no head size from a qwen3 file. With a Q8_0 embedding, a llama whose vocabulary
    is padded to whole blocks of the 8-bit kernel (as real models' are), so that its head reads it."""
    root, tokenizer = tmp_path_factory.mktemp("gguf"), tiny_models.make_tokenizer()
    size = dict(hidden_size=256, intermediate_size=512, initializer_range=0.05)
    folders = {
        "llama": tiny_models.build("llama", root / "llama", tokenizer, **size),
        "qwen3": tiny_models.build("qwen3", root / "qwen3", tokenizer, head_dim=128, **size),
    }
    made = {}

    def make(arch: str, qtype: T, embedding: T = T.F32):
        if (arch, qtype, embedding) not in made:
            if (arch, embedding) not in folders:
                padded = -(-len(tokenizer) // BLOCK) * BLOCK
                folders[arch, embedding] = tiny_models.build(
                    arch, root / f"{arch}-{embedding.name}", tokenizer, vocab_size=padded, **size
                )
            folder = folders[arch] if embedding == T.F32 else folders[arch, embedding]
            path = gguf_files.write(
                folder,
                root / f"{arch}-{qtype.name}-{embedding.name}.gguf",
                qtype,
                embedding_type=embedding,
            )
            made[arch, qtype, embedding] = tiny_profile(
                path, id=path.stem, tokenizer_source=str(folder)
            )
        return made[arch, qtype, embedding]

    return make


def last_logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), use_cache=False).logits[0].float()


def test_an_8bit_group_layer_computes_what_its_codes_and_scales_do():
    """Q8_0's codes (-128..127, the ends included) and group scales, run as two 4-bit layers."""
    torch.manual_seed(0)
    codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = torch.rand(32, 2) * 0.01 + 0.001
    layer = Int8GroupLinear(codes, scale, None)
    weight = codes.float() * scale.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    x = torch.randn(5, 64)
    want = x.to(torch.bfloat16).float() @ weight.t()
    torch.testing.assert_close(layer(x), want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_an_int4_layer_computes_what_its_dequantised_weight_does():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 128), torch.randn(96), torch.randn(3, 5, 128)
    layer = Int4Linear.quantize(weight, bias)
    groups = weight.reshape(96, -1, 32)
    low, scale = (
        groups.amin(-1, keepdim=True),
        (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15,
    )
    dequantised = (((groups - low) / scale).round() * scale + low).reshape(96, 128)
    expected = F.linear(x.bfloat16().float(), dequantised, bias)
    assert (layer(x) - expected).abs().max() <= 0.01 * expected.abs().max()
    assert (
        layer(x) - F.linear(x, weight, bias)
    ).abs().max() > 0.05  # 4 bits do cost something: the test can fail


def test_a_float8_layer_computes_what_its_weight_does_within_float8s_rounding():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 128), torch.randn(96), torch.randn(3, 5, 128)
    weight[7] *= 50  # a channel of its own scale: rows are scaled one by one
    layer = Float8Linear.quantize(
        weight, bias
    )  # (torch's CPU `_scaled_mm` runs it here; a node uses it on GPUs)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 96)
    expected = F.linear(x, weight, bias)
    error = (layer(x) - expected).abs()
    # float8_e4m3 keeps 3 bits of mantissa: about 6% of each weight and input, mostly averaging out
    assert error.max() <= 0.05 * expected.abs().max()
    assert (
        error[..., 7].max() > error[..., :7].max()
    )  # the wide channel's own scale: its error is its own
    assert (
        layer(x[:, :1]) - layer(x)[:, :1]
    ).abs().max() == 0  # a row's rounding does not depend on the others


def test_without_fp8_matmuls_fp8_runs_as_8_bit_integers(tmp_path):
    weight = torch.randn(64, 128)
    assert not quantized_linear.fits_fp8(weight)  # a CPU: no FP8 tensor cores
    assert type(quantized_linear.eight_bit(weight)) is Int8Linear
    folder = tiny_models.build(
        "llama",
        tmp_path / "llama",
        tiny_models.make_tokenizer(),
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.05,
    )
    lm = loader.load(tiny_profile(folder, quant="fp8"), "cpu")
    assert lm.quant == "int8" and any(isinstance(m, DynamicInt8Linear) for m in lm.model.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("qtype", [*EXACT, *REQUANTIZED], ids=lambda t: t.name)
def test_gguf_linear_weights_load_quantized_and_match_the_dequantised_model(
    gguf_models, arch, qtype
):
    profile = gguf_models(arch, qtype)
    stored, dequantised = (
        loader.load(profile, "cpu"),
        loader.load(profile.model_copy(update={"quant": "none"}), "cpu"),
    )
    halves = {
        id(half)
        for m in stored.model.modules()
        if isinstance(m, Int8GroupLinear)
        for half in (m.high, m.low)
    }
    layers = [
        m
        for m in stored.model.modules()
        if isinstance(m, (Int4Linear, Int8Linear, Int8GroupLinear)) and id(m) not in halves
    ]
    assert layers and all(type(m) is LAYOUT[qtype] for m in layers)
    assert (stored.quant, dequantised.quant) == (
        "int4" if LAYOUT[qtype] is Int4Linear else "int8",
        "none",
    )
    assert stored.weight_bytes < dequantised.weight_bytes
    assert not any(
        type(m) is torch.nn.Linear and m is not stored.model.lm_head for m in stored.model.modules()
    )
    ids = stored.tokenizer("The capital of France is Paris. Write a poem.")["input_ids"]
    got, want = last_logits(stored, ids), last_logits(dequantised, ids)
    bound = (EXACT | REQUANTIZED)[qtype]
    assert (got - want).abs().max() <= bound * want.abs().max(), (
        got - want
    ).abs().max() / want.abs().max()


@pytest.mark.parametrize(
    "arch, decode, qtype, embedding",
    [
        ("llama", "eager", T.Q4_1, T.F32),
        ("qwen3", "eager", T.Q4_1, T.F32),
        ("llama", "static", T.Q4_1, T.F32),
        ("llama", "eager", T.Q4_0, T.F32),
        ("qwen3", "eager", T.Q8_0, T.F32),
        ("llama", "compiled", T.Q4_1, T.Q8_0),  # the default model's layout: its head as stored
    ],
    ids=str,
)
def test_the_engine_decodes_a_quantized_model_as_hf_does_batched_prefix_cached_and_preempted(
    gguf_models, arch, decode, qtype, embedding
):
    profile = gguf_models(arch, qtype, embedding).model_copy(
        update={"prefill_chunk_tokens": 16, "kv_cache_mb": 1, "block_size": 4, "decode": decode}
    )
    lm = loader.load(profile, "cpu")
    requests = [
        request(f"j{i}", PROMPTS[i % 3], temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(6)
    ]
    got = run(
        Engine(lm, profile), *requests, join_every=2
    )  # arrivals join a running batch; repeats hit the cache
    for req in requests:
        ids = prompts.prompt_ids(lm.tokenizer, profile, req)
        assert got[req.job].token_ids[0] == full_forward_greedy(lm, ids, 12), req.job


@pytest.mark.skipif(not int8_groups_cpu.runs(), reason="the CPU kernels are not built here")
def test_an_output_head_tied_to_a_q8_0_embedding_is_read_as_stored(gguf_models):
    profile = gguf_models("llama", T.Q4_1, T.Q8_0)
    stored = loader.load(profile, "cpu")
    dense_head = loader.load(gguf_models("llama", T.Q4_1), "cpu")
    head = stored.model.get_output_embeddings()
    assert type(head) is CpuInt8GroupLinear and stored.quant == "int4"  # the layers' precision
    assert type(dense_head.model.get_output_embeddings()) is not CpuInt8GroupLinear
    # bfloat16 activations keep the packed bfloat16 head (2 bytes a weight; faster at batch)
    bf16 = loader.load(profile.model_copy(update={"dtype": "bfloat16"}), "cpu")
    assert type(bf16.model.get_output_embeddings()) is not CpuInt8GroupLinear
    assert stored.weight_bytes < dense_head.weight_bytes  # a byte a weight, not a packed copy
    # the embedding's rows are still looked up dense: the head's codes are the same numbers
    embedding = stored.model.get_input_embeddings().weight
    torch.testing.assert_close(head(torch.eye(embedding.shape[1])).T, embedding)
    dequantised = loader.load(profile.model_copy(update={"quant": "none"}), "cpu")
    ids = stored.tokenizer("The capital of France is Paris. Write a poem.")["input_ids"]
    got, want = last_logits(stored, ids), last_logits(dequantised, ids)
    assert (got - want).abs().max() <= EXACT[T.Q4_1] * want.abs().max()


def test_a_replica_says_which_kernels_its_matmuls_and_its_decode_step_run(gguf_models):
    """`LoadedModel.kernels` (node_agent/model/kernel_paths.py), and the heartbeat's `kernels` with
    the decode step's kind: the default model's shape, 4-bit layers and a Q8_0 head read as stored."""
    profile = gguf_models("llama", T.Q4_1, T.Q8_0)
    stored = loader.load(profile, "cpu")
    layers, head = stored.kernels.split("; head: ")
    if int4_tiles.layout() is not None:
        block_n, _, rows = int4_tiles.kernel_args()
        packing = "AVX-512" if block_n == 64 else "AVX2"
        assert layers == (
            f"int4: torch's int4 kernel below {rows} rows, the node's tiles from {rows} "
            f"({packing} packing)"
        )
    else:
        assert layers == "int4: torch's int4 kernel"
    assert head.startswith("the node's 8-bit groups")
    full = loader.load(profile.model_copy(update={"quant": "none"}), "cpu")
    assert full.kernels == "float32: oneDNN over packed weights"  # the head packed like the rest
    facts = Engine(stored, profile.model_copy(update={"decode": "eager"})).replica_facts()
    assert facts["kernels"] == f"{stored.kernels}; decode step: eager"


def test_int4_and_int8_quantize_a_full_precision_checkpoint_at_load(tmp_path):
    folder = tiny_models.build(
        "llama",
        tmp_path / "llama",
        tiny_models.make_tokenizer(),
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.05,
    )
    profile = tiny_profile(folder)
    full = loader.load(profile.model_copy(update={"quant": "none"}), "cpu")
    ids = full.tokenizer("Hello there, what is it?")["input_ids"]
    want = last_logits(full, ids)
    # measured 0.081, 0.22; a CPU's int8 is torch's dynamic int8 (faster there than Int8Linear), head included
    for quant, layer, count, bound in [
        ("int8", DynamicInt8Linear, 15, 0.12),
        ("int4", Int4Linear, 8, 0.35),  # q/k/v and gate/up each stacked as one
    ]:
        lm = loader.load(profile.model_copy(update={"quant": quant}), "cpu")
        assert (
            sum(isinstance(m, layer) for m in lm.model.modules()) == count
        )  # q k v o gate up down, 2 layers
        error = (last_logits(lm, ids) - want).abs().max() / want.abs().max()
        assert error <= bound, (quant, error)
        assert lm.quant == quant and lm.weight_bytes < full.weight_bytes


def test_placement_counts_the_weights_as_the_node_holds_them(gguf_models, monkeypatch):
    profile = gguf_models("llama", T.Q4_0).model_copy(update={"kv_cache_mb": 1, "slots": 1})
    # Linear layers left as they load: a packed output head is a copy of the tied embedding
    monkeypatch.setattr(loader, "_tune_for_cpu", lambda model, profile: None)
    lm = loader.load(profile, "cpu")
    none = loader.load(profile.model_copy(update={"quant": "none"}), "cpu")
    tensors = memory._gguf_facts(Path(profile.source))[0]
    assert memory.weight_bytes(tensors, "auto", 4) == pytest.approx(
        quantized_linear.weight_bytes(lm.model), rel=0.01
    )
    assert memory.weight_bytes(tensors, "none", 4) == quantized_linear.weight_bytes(none.model)


def test_the_default_models_file_runs_4_bit_with_its_embedding_dense():
    profile = Catalog.load(None).resolve("default")
    tensors = memory.stored_facts(memory.locate(profile))[0]
    assert profile.quant == "auto"
    # 4-bit layers (66 MB) and the float32 embedding its output head shares (113 MB): 0.34x of 538 MB
    assert memory.weight_bytes(tensors, "auto", 4) < 0.35 * memory.weight_bytes(tensors, "none", 4)


_PEAK_SCRIPT = """
import json, sys
from pathlib import Path
from shared.catalog import ModelProfile
from node_agent.model import int8_groups_cpu, loader, quantized_linear
from node_agent.model.int8_groups_cpu import BLOCK, CpuInt8GroupLinear
warm_up, profile = (ModelProfile.model_validate_json(arg) for arg in sys.argv[1:])
loader.load(warm_up, "cpu")  # every module the load imports, imported
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024
base = status("VmRSS")
lm = loader.load(profile, "cpu")
print(json.dumps({"base": base, "peak": status("VmHWM"), "weights": quantized_linear.weight_bytes(lm.model)}))
"""


def load_peak(warm_up: str, profile: str) -> dict:
    """In a fresh process, once `warm_up` (a profile's JSON) has loaded: the process's resident
    bytes before `profile` loads ("base"), its peak while it does ("peak"), and what the model's
    weights take ("weights")."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, warm_up, profile],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[3],
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # loads in a fresh process to measure its peak memory
def test_a_quantized_load_never_holds_the_full_precision_model(tmp_path):
    """8 layers of hidden 512: 101 MB at float32, 15 MB as Q4_0. What the load adds at its peak
    stays within the file's size, one layer at float32 and a fixed allowance, under the float32
    model's size: 30 MB added here. Without the freed pages handed back after each block the
    allocator kept per-tensor temporaries as slack between the long-lived packed weights (46-68 MB)."""
    tokenizer = tiny_models.make_tokenizer()
    files = {}
    for name, size in [
        ("small", {}),
        (
            "wide",
            dict(
                hidden_size=512,
                intermediate_size=1536,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=4,
            ),
        ),
    ]:
        folder = tiny_models.build("llama", tmp_path / name, tokenizer, **size)
        files[name] = gguf_files.write(folder, tmp_path / f"{name}.gguf", T.Q4_0)
        files[name + "-profile"] = tiny_profile(
            files[name], tokenizer_source=str(folder)
        ).model_dump_json()
    figures = load_peak(files["small-profile"], files["wide-profile"])
    full_precision = 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536) * 4
    one_layer = full_precision // 8
    added = figures["peak"] - figures["base"]
    assert added <= files["wide"].stat().st_size + one_layer + (16 << 20) < full_precision, (
        figures | {"added": added}
    )


@pytest.mark.slow  # loads the default model twice (~20 s)
def test_a_gguf_files_config_and_tokenizer_are_kept_and_read_back_on_the_next_load(
    tmp_path, monkeypatch
):
    """transformers parses the whole GGUF header (its vocabulary) for the config and again for the
    tokenizer: the first load keeps both as a folder in the convert cache, later loads read that."""
    profile = (
        Catalog.load(None).resolve("default").model_copy(update={"kv_cache_mb": 1, "slots": 1})
    )
    first = loader.load(profile, "cpu", None, tmp_path)
    kept = next(tmp_path.glob("*-header"))
    assert (kept / "config.json").exists() and (kept / "tokenizer.json").exists()
    sources = []
    for reader in (loader.AutoConfig, loader.AutoTokenizer):
        plain = reader.from_pretrained
        monkeypatch.setattr(
            reader,
            "from_pretrained",
            lambda *a, plain=plain, **kw: (
                sources.append((a[0], kw.get("gguf_file"))) or plain(*a, **kw)
            ),
        )
    again = loader.load(profile, "cpu", None, tmp_path)
    assert len(sources) >= 2 and set(sources) == {
        (kept, None)
    }  # (the tokenizer reads the config too)
    assert again.quant == first.quant == "int4"
    assert again.tokenizer.get_vocab() == first.tokenizer.get_vocab()
    assert again.tokenizer.chat_template == first.tokenizer.chat_template
    where = lambda lm: lm.model.config.to_dict() | {"_name_or_path": None}  # noqa: E731  (the folder read from)
    assert where(again) == where(first)
