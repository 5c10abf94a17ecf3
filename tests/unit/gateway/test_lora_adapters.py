"""LoRA adapters as names: catalogue entries with `base` resolve to their base, conflict with no
other name, and keys' model allow-lists apply to the adapter's own names; run-time declarations
(vLLM's load/unload bodies) name their base or find it in the adapter's files."""

import json

import pytest

from gateway.fleet import adapters
from gateway.jobs.caller import Caller
from shared.api_keys import ApiKey
from shared.catalog import AdapterProfile, Catalog, ModelProfile
from shared.errors import Conflict, InvalidRequest, ModelNotAllowed, NotFound


def catalog() -> Catalog:
    return Catalog(
        [
            ModelProfile(id="tiny", source="/m", aliases=["t"]),
            ModelProfile(id="e", source="/e", kind="embedding"),
        ],
        [AdapterProfile(id="support-bot", base="t", adapter="/a", aliases=["sb"])],
    )


def key(*models: str) -> Caller:
    return Caller("k", ApiKey(name="k", hash="h", hint="sk", models=list(models), created_ms=0))


def test_an_adapter_resolves_to_its_base_and_its_names_are_its_own():
    c = catalog()
    assert c.resolve("sb").id == "tiny" and c.adapter_of("support-bot:latest").base == "tiny"
    assert c.adapter_of("tiny") is None and c.names("support-bot") == {"support-bot", "sb"}
    with pytest.raises(Conflict):
        c.add_adapter(AdapterProfile(id="t", base="tiny", adapter="/b"))
    with pytest.raises(InvalidRequest, match="not a generating model"):
        c.add_adapter(AdapterProfile(id="x", base="e", adapter="/b"))


def test_keys_allow_lists_apply_to_adapter_names():
    c = catalog()
    base, adapter = c.resolve("support-bot"), c.adapter_of("support-bot")
    key("sb").check_may_use(base, adapter)
    with pytest.raises(ModelNotAllowed, match="support-bot"):
        key("tiny").check_may_use(base, adapter)  # the base's key does not reach its adapters
    with pytest.raises(ModelNotAllowed):
        key("support-bot").check_may_use(base)


def test_run_time_adapters_find_their_base(tmp_path):
    c = catalog()
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/m"}))
    assert adapters.load(c, "rt", str(tmp_path)).base == "tiny"  # by the base's source
    with pytest.raises(Conflict):
        adapters.load(c, "rt", str(tmp_path))
    assert adapters.unload(c, "rt").id == "rt" and c.adapter_of("rt") is None
    with pytest.raises(NotFound):
        adapters.unload(c, "rt")
    two = Catalog([ModelProfile(id="a", source="/a"), ModelProfile(id="b", source="/b")])
    with pytest.raises(InvalidRequest, match="base_model_name"):
        adapters.load(two, "rt", str(tmp_path / "nowhere"))
    assert adapters.load(two, "rt", str(tmp_path), base="b").base == "b"
