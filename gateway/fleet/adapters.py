"""LoRA adapters declared at run time (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`): into and out of this gateway's catalogue, which then resolves the
adapter's name to its base's streams (gateway/jobs/submit.py). The nodes read the adapter's files
when its first request comes (node_agent/model/lora_files.py), and fail that request with why when
they cannot; nothing is read here but the base the adapter names, when no base is given."""

import json
from pathlib import Path

from shared.catalog import AdapterProfile, Catalog
from shared.errors import Conflict, InvalidRequest, NotFound


def _named_base(catalog: Catalog, path: str) -> str | None:
    """The catalogue model an adapter's `adapter_config.json` names as its base (by id, alias or
    source), where this gateway can read it."""
    try:
        named = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    base = str(named.get("base_model_name_or_path") or "")
    for profile in catalog.profiles.values():
        if base and base in {profile.id, *profile.aliases, profile.source.removeprefix("hf:")}:
            return profile.id
    return None


def load(catalog: Catalog, name: str, path: str, base: str | None = None) -> AdapterProfile:
    """Declare adapter `name` at `path` on `base` (else the base its files name, else the
    catalogue's only generating model); Conflict when the name is taken."""
    if name in catalog.adapters:
        raise Conflict(f"The LoRA adapter {name!r} is already loaded; unload it first")
    generating = [p.id for p in catalog.profiles.values() if p.kind == "generate"]
    base = base or _named_base(catalog, path) or (generating[0] if len(generating) == 1 else None)
    if base is None:
        raise InvalidRequest(
            f"adapter {name!r}: say which model it runs on (base_model_name): its files name none "
            f"of the catalogue's ({', '.join(generating)})",
            param="base_model_name",
        )
    adapter = AdapterProfile(id=name, base=base, adapter=path)
    catalog.add_adapter(adapter)
    return catalog.adapters[name]


def unload(catalog: Catalog, name: str) -> AdapterProfile:
    adapter = catalog.remove_adapter(name)
    if adapter is None:
        raise NotFound(f"The LoRA adapter {name!r} is not loaded")
    return adapter
