"""Catalogue plus live fleet state → Ollama's `/api/tags`, `/api/show` and `/api/ps`.

Names carry Ollama's tag: a catalogue id or alias without one is listed as `name:latest` (which
the catalogue resolves back). The gateway does not hold the models' files (nodes do), so what
Ollama reads from a GGUF header comes from the catalogue and the heartbeats instead: the format
from the source, the context from the loaded replicas (else the catalogue's `max_model_len`),
sizes from what replicas hold, `general.architecture` as "cortex". A digest is the sha256 of the
model's catalogue profile: it changes when the profile does.
"""

import hashlib
from datetime import UTC, datetime

from gateway.dialects.protocol.ollama import (
    Capability,
    ListModelResponse,
    ListResponse,
    ModelDetails,
    ProcessModelResponse,
    ProcessResponse,
    ShowResponse,
)
from shared.catalog import LATEST_TAG, ModelProfile
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.lifecycle import ModelState

ARCHITECTURE = "cortex"
NEVER = datetime(
    9999, 12, 31, tzinfo=UTC
)  # `expires_at` of a model that is never unloaded for idleness
MIB = 1024 * 1024


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}{LATEST_TAG}"


def digest(profile: ModelProfile) -> str:
    return hashlib.sha256(profile.model_dump_json().encode()).hexdigest()


def details(profile: ModelProfile) -> ModelDetails:
    gguf = profile.gguf_file is not None or profile.source.endswith(".gguf")
    return ModelDetails(
        format="gguf" if gguf else "safetensors",
        family=ARCHITECTURE,
        families=[ARCHITECTURE],
        quantization_level="" if profile.quant in ("auto", "none") else profile.quant.upper(),
    )


def capabilities(profile: ModelProfile) -> list[Capability]:
    """Every generation model completes and calls tools (a model whose template has no tools is
    prompted in the hermes format: gateway/dialects/tools/parsers.py); `vision` ones read images. An
    embedding model embeds; a rerank model has nothing Ollama names."""
    if profile.kind != "generate":
        return ["embedding"] if profile.kind == "embedding" else []
    return ["completion", "tools", *(["vision"] if profile.vision else [])]


def _replicas(
    profile: ModelProfile, nodes: list[NodeHeartbeat]
) -> list[tuple[NodeHeartbeat, ModelInfo]]:
    """The live replicas of the model that are ready."""
    return [
        (node, node.models[profile.id])
        for node in nodes
        if node.models.get(profile.id) is not None
        and node.models[profile.id].state == ModelState.READY
    ]


def _since(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _context(profile: ModelProfile, replicas: list[tuple[NodeHeartbeat, ModelInfo]]) -> int:
    return min(
        (info.max_model_len for _, info in replicas if info.max_model_len),
        default=profile.max_model_len,
    )


def _names(profile: ModelProfile) -> list[str]:
    return [tagged(name) for name in (profile.id, *profile.aliases)]


def model_list(profiles: list[ModelProfile], nodes: list[NodeHeartbeat]) -> ListResponse:
    """Each model under its id, then under each alias (the same digest), as Ollama lists tags."""
    models = []
    for profile in profiles:
        replicas = _replicas(profile, nodes)
        size = max((info.memory_mb for _, info in replicas), default=profile.memory_mb or 0) * MIB
        modified = _since(min((node.started_ms for node, _ in replicas), default=0))
        models += [
            ListModelResponse(
                name=name,
                model=name,
                modified_at=modified,
                size=size,
                digest=digest(profile),
                details=details(profile),
            )
            for name in _names(profile)
        ]
    return ListResponse(models=models)


def show(profile: ModelProfile, nodes: list[NodeHeartbeat]) -> ShowResponse:
    """`model_info` holds what VS Code's Copilot Chat reads: `general.architecture`,
    `{architecture}.context_length` and `general.basename`."""
    replicas = _replicas(profile, nodes)
    context = _context(profile, replicas)
    parameters = f"num_ctx {context}" + (
        f"\nnum_predict {profile.default_max_tokens}" if profile.default_max_tokens else ""
    )
    return ShowResponse(
        modelfile=f"FROM {profile.source}\n"
        + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
        parameters=parameters,
        template=profile.chat_template or "",
        details=details(profile),
        model_info={
            "general.architecture": ARCHITECTURE,
            "general.basename": profile.id,
            f"{ARCHITECTURE}.context_length": context,
        },
        capabilities=capabilities(profile),
        modified_at=_since(min((node.started_ms for node, _ in replicas), default=0)),
    )


def _expires_at(
    profile: ModelProfile, pinned: bool, replicas: list[tuple[NodeHeartbeat, ModelInfo]]
) -> datetime:
    """When the last replica unloads for idleness: its catalogue `keep_alive_s` after its last job,
    or later when a request's `keep_alive` asked for it."""
    if pinned or profile.keep_alive_s < 0:
        return NEVER
    keep_alive_ms = int(profile.keep_alive_s * 1000)
    return _since(
        max(max(info.last_used_ms + keep_alive_ms, info.keep_until_ms) for _, info in replicas)
    )


def running(
    profiles: list[ModelProfile], nodes: list[NodeHeartbeat], pinned: set[str]
) -> ProcessResponse:
    """The models some live node holds ready: memory summed over replicas (`size_vram`: on GPUs),
    when the last replica would unload for idleness, and Cortex's `nodes` that hold it."""
    models = []
    for profile in profiles:
        replicas = _replicas(profile, nodes)
        if not replicas:
            continue
        size = sum(info.memory_mb for _, info in replicas) * MIB
        vram = sum(info.memory_mb for _, info in replicas if info.device.startswith("cuda")) * MIB
        name = tagged(profile.id)
        models.append(
            ProcessModelResponse(
                name=name,
                model=name,
                size=size,
                digest=digest(profile),
                details=details(profile),
                expires_at=_expires_at(profile, profile.id in pinned, replicas),
                size_vram=vram,
                context_length=_context(profile, replicas),
                nodes=[node.node for node, _ in replicas],
            )
        )
    return ProcessResponse(models=models)
