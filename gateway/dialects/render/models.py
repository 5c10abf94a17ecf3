"""Catalogue plus live fleet state -> the `/v1/models` list."""

from collections.abc import Callable

from gateway.dialects.protocol.openai import Model, ModelList, ModelReplica
from shared.catalog import Catalog
from shared.errors import ModelNotFound
from shared.heartbeat import NodeHeartbeat
from shared.lifecycle import ModelState

_RANK = [
    ModelState.READY,
    ModelState.LOADING,
    ModelState.DOWNLOADING,
    ModelState.SLEEPING,
    ModelState.UNLOADING,
    ModelState.POISONED,
    ModelState.FAILED,
]


def model_list(
    catalog: Catalog,
    nodes: list[NodeHeartbeat],
    may_use: Callable[[set[str]], bool] = lambda names: True,
) -> ModelList:
    """Every catalogue model (loaded or not), then models live nodes serve outside the catalogue;
    each with its replicas and its best state, only those `may_use` (given a model's id and aliases)
    allows; then each alias (`default` …) as an entry of its own whose `root` is the model it names
    (a model's `root` is itself); then each LoRA adapter the caller may use whose base is listed,
    with `parent` its base. `created` is when the earliest node holding it started (0 when none does);
    `max_model_len` the shortest context its loaded replicas run with (None while none is loaded)."""
    replicas: dict[str, list[ModelReplica]] = {}
    created: dict[str, int] = {}
    context: dict[str, int] = {}
    for node in nodes:
        for model, info in node.models.items():
            replicas.setdefault(model, []).append(
                ModelReplica(
                    node=node.node,
                    state=info.state,
                    slots_used=info.slots_used,
                    slots_total=info.slots_total,
                    download_fraction=info.download.fraction if info.download else None,
                    quant=info.quant or None,
                    weight_mb=info.weight_mb or None,
                    kernels=info.kernels or None,
                )
            )
            created[model] = min(
                created.get(model, node.started_ms // 1000), node.started_ms // 1000
            )
            if info.max_model_len:
                context[model] = min(context.get(model, info.max_model_len), info.max_model_len)
    serving = (ModelState.READY, ModelState.DOWNLOADING, ModelState.LOADING)
    extra = sorted(
        m
        for m in replicas
        if m not in catalog.profiles and any(r.state in serving for r in replicas[m])
    )
    data = []
    for model in [*catalog.profiles, *extra]:
        if not may_use(catalog.names(model)):
            continue
        profile = catalog.profiles.get(model)
        held = replicas.get(model, [])
        state = min((r.state for r in held), key=_RANK.index, default="not_loaded")
        data.append(
            Model(
                id=model,
                created=created.get(model, 0),
                state=state,
                replicas=held,
                root=model,
                capabilities=["vision"] if profile and profile.vision else [],
                kind=profile.kind if profile else "generate",
                max_model_len=context.get(model),
            )
        )
    by_id = {m.id: m for m in data}
    data += [
        by_id[p.id].model_copy(update={"id": alias, "root": p.id})
        for p in catalog.profiles.values()
        if p.id in by_id
        for alias in p.aliases
    ]
    data += [  # LoRA adapters, as vLLM lists them: on their base's replicas, `parent` the base
        by_id[a.base].model_copy(update={"id": name, "root": a.id, "parent": a.base})
        for a in catalog.adapters.values()
        if a.base in by_id and may_use(catalog.names(a.id))
        for name in [a.id, *a.aliases]
    ]
    return ModelList(data=data)


def model_card(
    catalog: Catalog,
    nodes: list[NodeHeartbeat],
    name: str,
    may_use: Callable[[set[str]], bool] = lambda names: True,
) -> Model:
    """One entry of the list, by id or alias."""
    for model in model_list(catalog, nodes, may_use).data:
        if model.id == name:
            return model
    raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
