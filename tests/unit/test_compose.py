"""compose.yaml parses, names the services, keeps Redis on a volume with persistence on, gives the node
agent a GPU, and sets only variables that are real settings."""

from pathlib import Path

import pytest
import yaml

from shared.processes import PUBSUB_BUFFER_LIMIT, SNAPSHOTS, redis_server_argv
from shared.settings import GatewaySettings, NodeSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"gateway": GatewaySettings, "node-agent": NodeSettings}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_names_its_services(compose):
    default = {name for name, service in compose["services"].items() if not service.get("profiles")}
    assert default == {"redis", "gateway", "batch-worker", "node-agent"}
    assert set(compose["services"]) - default == {
        "prometheus",
        "grafana",
        "jaeger",
    }  # `--profile monitoring`
    assert compose["services"]["redis"]["image"].startswith("redis:7")


def test_traces_are_off_unless_asked_and_jaeger_can_receive_them(compose):
    assert (
        compose["x-cortex-env"]["CORTEX_OTLP_ENDPOINT"] == "${CORTEX_OTLP_ENDPOINT:-}"
    )  # empty unless set
    for name in SETTINGS:
        assert (
            compose["services"][name]["environment"]["CORTEX_OTLP_ENDPOINT"]
            == "${CORTEX_OTLP_ENDPOINT:-}"
        )
    assert (
        "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318"
        in compose["services"]["jaeger"]["command"]
    )


def test_gateway_and_node_are_built_from_the_dockerfile(compose):
    assert (ROOT / "Dockerfile").is_file()
    for name in SETTINGS:
        assert compose["services"][name]["build"] in (".", {"context": "."})


def test_node_agent_reserves_all_nvidia_gpus(compose):
    (device,) = compose["services"]["node-agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["count"] == "all"
    assert device["capabilities"] == ["gpu"]


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_environment_names_real_settings(compose, service):
    env = compose["services"][service]["environment"]
    assert env["CORTEX_REDIS_URL"] == "redis://redis:6379/0"
    fields = SETTINGS[service].model_fields
    for name in env:
        if name.startswith("CORTEX_") and name != "CORTEX_CONFIG":
            assert name.removeprefix("CORTEX_").lower() in fields, (
                f"{service}: {name} is not a setting"
            )


def test_environment_values_are_valid_settings(compose, monkeypatch):
    for service, cls in SETTINGS.items():
        for name, value in compose["services"][service]["environment"].items():
            monkeypatch.setenv(name, str(value))
        settings = cls()
        assert settings.redis_url == "redis://redis:6379/0"
        for name in compose["services"][service]["environment"]:
            monkeypatch.delenv(name)


def test_gateway_listens_on_all_interfaces_on_the_published_port(compose):
    gateway = compose["services"]["gateway"]
    assert gateway["environment"]["CORTEX_HOST"] == "0.0.0.0"
    assert f"{gateway['environment']['CORTEX_PORT']}:31313" in gateway["ports"]


def test_redis_is_durable_on_a_named_volume(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "everysec"
    assert options["--save"] == SNAPSHOTS and options["--maxmemory-policy"] == "noeviction"
    assert (
        options["--stop-writes-on-bgsave-error"] == "no"
    )  # the append-only file holds every write
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in compose["volumes"]


def test_redis_pubsub_output_buffer_is_set_knowingly(compose):
    """As every redis-server Cortex starts (`cortex up`, scripts, tests): `redis_server_argv`."""
    command = compose["services"]["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--client-output-buffer-limit"] == PUBSUB_BUFFER_LIMIT
    argv = redis_server_argv(6379)
    assert argv[argv.index("--client-output-buffer-limit") + 1] == PUBSUB_BUFFER_LIMIT
