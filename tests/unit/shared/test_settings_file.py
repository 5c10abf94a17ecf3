"""One settings file for every process (`--config`, CORTEX_CONFIG: shared/settings.py): the one
the packages ship (packaging/cortex.toml) reads into each part's settings, its tables apply to
their part only (the batch worker: [gateway], then [batch] over it), environment variables win,
and its catalogue (packaging/models.toml) is the built-in one the packages install."""

import os
from pathlib import Path

import pytest

from gateway.cli import main
from shared.catalog import BUILTIN, Catalog
from shared.settings import BatchSettings, GatewaySettings, NodeSettings

PACKAGING = Path(__file__).resolve().parents[3] / "packaging"


@pytest.fixture
def config(monkeypatch, tmp_path):
    """Write a settings file and name it in CORTEX_CONFIG (no CORTEX_* variable set)."""
    for name in ("CORTEX_REDIS_URL", "CORTEX_PORT", "CORTEX_MODELS", "CORTEX_COMPILE_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def write(text: str) -> Path:
        path = tmp_path / "cortex.toml"
        path.write_text(text)
        monkeypatch.setenv("CORTEX_CONFIG", str(path))
        return path

    return write


def test_the_shipped_file_reads_into_every_part(config):
    config((PACKAGING / "cortex.toml").read_text())
    gateway, node, batch = GatewaySettings(), NodeSettings(), BatchSettings()
    for settings in (gateway, node, batch):
        assert settings.redis_url == "redis://127.0.0.1:6379/0"
        assert settings.models_file == Path("/etc/cortex/models.toml")
    assert (gateway.host, gateway.port) == ("127.0.0.1", 31313)
    assert node.models == ["SmolLM2-135M-Instruct"]
    assert node.models_dir == Path("/var/lib/cortex/models")
    assert node.compile_cache == Path("/var/cache/cortex/compiled")
    assert node.hf_cache == "/var/cache/cortex/huggingface"
    assert batch.batch_max_concurrent == 16


def test_the_batch_worker_reads_gateway_then_batch(config):
    config("[gateway]\nstream_maxlen = 500\nport = 1\n[batch]\nport = 2\n[node]\nport = 3\n")
    batch = BatchSettings()
    assert (batch.stream_maxlen, batch.port) == (500, 2)
    assert GatewaySettings().port == 1


def test_environment_variables_override_the_file(config, monkeypatch):
    config('redis_url = "redis://file:1/0"\n[node]\nmodels = ["a"]\n')
    monkeypatch.setenv("CORTEX_REDIS_URL", "redis://env:2/0")
    monkeypatch.setenv("CORTEX_MODELS", '["b"]')
    node = NodeSettings()
    assert (node.redis_url, node.models) == ("redis://env:2/0", ["b"])


def test_config_flag_names_the_file_for_each_part(monkeypatch):
    monkeypatch.setenv("CORTEX_CONFIG", "")  # restored after the test, whatever happens
    for part in ("gateway", "node", "batch-worker"):
        args = main.build_parser().parse_args([part, "--config", "/etc/cortex/cortex.toml"])
        main._apply_common(args)
        assert Path(os.environ["CORTEX_CONFIG"]) == Path("/etc/cortex/cortex.toml")
        os.environ["CORTEX_CONFIG"] = ""


def test_the_shipped_catalogue_is_the_built_in_one():
    shipped = Catalog.load(PACKAGING / "models.toml").profiles
    assert shipped == {profile.id: profile for profile in BUILTIN}
