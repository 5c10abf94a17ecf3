"""What runs on a device thread to bring a replica up: load its model (a generating one sharded
over its devices when tensor-parallel) and build its engine. The serving layer's only way into
node_agent/model and node_agent/tp."""

from node_agent.engine.engine import Engine
from node_agent.engine.pooler import PoolingEngine
from node_agent.model import loader, pooling
from node_agent.tp import tensor_parallel
from shared.catalog import ModelProfile
from shared.model_files import ModelLoadError
from shared.settings import NodeSettings


def start_engine(
    profile: ModelProfile, device_ids: list[str], settings: NodeSettings, node: str
) -> Engine:
    """On the device thread: load the model (sharded over `device_ids` when tensor-parallel) and
    build its engine; a tensor-parallel model's other ranks stop if that fails."""
    if profile.tensor_parallel > 1:
        loaded = tensor_parallel.load(profile, device_ids, settings, node)
    else:
        loaded = loader.load(profile, device_ids[0], settings.hf_cache, settings.convert_cache)
    try:
        kv_disk = (settings.kv_disk_dir, settings.kv_disk_gb) if settings.kv_disk_dir else None
        return Engine(loaded, profile, node, settings.compile_cache, kv_disk)
    except BaseException:
        if loaded.group is not None:
            loaded.group.close()
        raise


def start_pooler(profile: ModelProfile, device: str, settings: NodeSettings) -> PoolingEngine:
    """On the device thread: load an embedding or rerank model and build its engine."""
    if profile.tensor_parallel > 1:
        raise ModelLoadError(
            f"{profile.id}: embedding and rerank models run on one device (tensor_parallel = 1)"
        )
    return PoolingEngine(pooling.load(profile, device, settings.hf_cache), profile)
