"""Live fleet state → the `/v1/models` list."""

from gateway.protocol.openai import Model, ModelList
from shared.catalog import Catalog
from shared.heartbeat import NodeHeartbeat


def model_list(catalog: Catalog, nodes: list[NodeHeartbeat]) -> ModelList:
    """Models ready or loading on `nodes`, catalogue order first; `created` is when the
    earliest node serving it started."""
    created: dict[str, int] = {}
    for node in nodes:
        for model in node.models:
            if node.serves(model):
                created[model] = min(created.get(model, node.started_ms // 1000), node.started_ms // 1000)
    order = [*catalog.profiles, *sorted(set(created) - set(catalog.profiles))]
    return ModelList(data=[Model(id=model, created=created[model]) for model in order if model in created])
