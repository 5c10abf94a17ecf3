"""docs/grafana: the Grafana dashboard asks only for series the gateway's /metrics really has, and
docker compose's `monitoring` profile provisions it with the Prometheus it reads."""

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.heartbeat import KVCacheStats
from shared.lifecycle import ModelState
from tests.unit.gateway.conftest import MODEL, beat

ROOT = Path(__file__).resolve().parents[3]
GRAFANA = ROOT / "docs" / "grafana"
DASHBOARD = json.loads((GRAFANA / "cortex-dashboard.json").read_text())
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def queries() -> list[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    return exprs + [
        v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"
    ]


async def test_every_query_names_series_the_gateway_exports(app, client, redis):
    await beat(
        redis,
        "n1",
        {MODEL: ModelState.READY},
        kv={MODEL: KVCacheStats(block_size=16, blocks_total=10)},
    )
    ctx = app.state.ctx
    await ctx.metrics.refresh(ctx.fleet, set(ctx.catalog.profiles))
    families = text_string_to_metric_families((await client.get("/metrics")).text)
    exported = {f.name + suffix for f in families for suffix in SUFFIXES.get(f.type, ("",))}
    named = {
        name for expr in queries() for name in re.findall(r"\b(?:cortex|vllm):[a-zA-Z0-9_:]+", expr)
    }
    assert named and named <= exported, named - exported
    assert {
        "cortex:generation_tokens_total",
        "cortex:time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    } <= named


def test_the_dashboard_is_a_grafana_dashboard_on_the_provisioned_prometheus():
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels) > 10
    datasource = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "cortex.yaml").read_text()
    )["datasources"][0]
    for p in panels:
        assert (
            p["type"] == "timeseries" and p["title"] and set(p["gridPos"]) == {"h", "w", "x", "y"}
        )
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
        assert {p["datasource"]["uid"]} | {t["datasource"]["uid"] for t in p["targets"]} == {
            datasource["uid"]
        }
    spots = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(spots) == len(panels)  # no panel drawn over another


def test_the_monitoring_profile_mounts_what_it_names():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    monitoring = {name: s for name, s in compose.items() if "monitoring" in s.get("profiles", [])}
    assert set(monitoring) == {"prometheus", "grafana", "jaeger"}
    for service in monitoring.values():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == [
        "gateway:31313"
    ]
    assert "31313:31313" in compose["gateway"]["ports"]
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "cortex.yaml").read_text()
    )["providers"][0]
    assert any(
        m.endswith(provider["options"]["path"] + "/cortex-dashboard.json:ro")
        for m in monitoring["grafana"]["volumes"]
    )
