"""/metrics: each replica's KV cache, prefix cache and speculative decoding under vLLM's names,
from heartbeats."""

from prometheus_client.parser import text_string_to_metric_families

from shared.heartbeat import KVCacheStats, SpecDecodeStats
from shared.lifecycle import ModelState
from tests.unit.gateway.conftest import MODEL, beat

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


async def scrape(app, client) -> dict:
    """The KV families after a refresh (the lifespan's loop refreshes every REFRESH_S)."""
    ctx = app.state.ctx
    await ctx.metrics.refresh(ctx.fleet, set(ctx.catalog.profiles))
    text = (await client.get("/metrics")).text
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def values(family) -> dict[tuple[str, str, str], float]:
    return {(s.name, s.labels["model"], s.labels["node"]): s.value for s in family.samples}


async def test_usage_is_a_gauge_and_the_prefix_cache_and_preemptions_are_counters(
    app, client, redis
):
    kv = KVCacheStats(
        block_size=16,
        blocks_total=400,
        blocks_used=148,
        blocks_cached=52,
        prefix_queries=1000,
        prefix_hits=810,
        preemptions=3,
    )
    await beat(
        redis, "n1", {MODEL: ModelState.READY, "Loading-Model": ModelState.LOADING}, kv={MODEL: kv}
    )
    await beat(
        redis,
        "n2",
        {MODEL: ModelState.READY},
        kv={MODEL: KVCacheStats(block_size=16, blocks_total=100)},
    )
    await beat(redis, "dead", {MODEL: ModelState.READY}, kv={MODEL: kv}, age_s=60)

    families = await scrape(app, client)

    usage = families["vllm:kv_cache_usage_perc"]
    assert usage.type == "gauge"
    assert values(usage) == {
        ("vllm:kv_cache_usage_perc", MODEL, "n1"): 0.37,
        ("vllm:kv_cache_usage_perc", MODEL, "n2"): 0.0,
    }
    for name, expected in zip(COUNTERS, (1000, 810, 3)):
        assert families[name].type == "counter"
        assert values(families[name]) == {
            (f"{name}_total", MODEL, "n1"): expected,
            (f"{name}_total", MODEL, "n2"): 0,
        }


async def test_speculative_decoding_counters_per_replica(app, client, redis):
    await beat(
        redis,
        "n1",
        kv={MODEL: KVCacheStats(blocks_total=10)},
        spec={MODEL: SpecDecodeStats(drafts=40, draft_tokens=200, accepted_tokens=150)},
    )
    await beat(
        redis, "n2", kv={MODEL: KVCacheStats(blocks_total=10)}
    )  # a node from before speculation: none

    families = await scrape(app, client)

    for name, expected in zip(SPEC_COUNTERS, (40, 200, 150)):
        assert families[name].type == "counter"
        assert values(families[name]) == {(f"{name}_total", MODEL, "n1"): expected}


async def test_counters_follow_the_node_so_a_restart_reads_as_a_reset(app, client, redis):
    await beat(
        redis,
        "n1",
        kv={
            MODEL: KVCacheStats(blocks_total=10, prefix_queries=500, prefix_hits=400, preemptions=2)
        },
    )
    before = await scrape(app, client)
    await beat(
        redis, "n1", kv={MODEL: KVCacheStats(blocks_total=10, prefix_queries=20, prefix_hits=5)}
    )
    after = await scrape(app, client)

    assert values(before["vllm:prefix_cache_hits"]) == {
        ("vllm:prefix_cache_hits_total", MODEL, "n1"): 400
    }
    assert values(after["vllm:prefix_cache_hits"]) == {
        ("vllm:prefix_cache_hits_total", MODEL, "n1"): 5
    }
    assert values(after["vllm:prefix_cache_queries"]) == {
        ("vllm:prefix_cache_queries_total", MODEL, "n1"): 20
    }
    assert values(after["vllm:num_preemptions"]) == {("vllm:num_preemptions_total", MODEL, "n1"): 0}


async def test_a_replica_gone_from_the_heartbeats_leaves_the_metrics(app, client, redis):
    await beat(redis, "n1", kv={MODEL: KVCacheStats(blocks_total=10, blocks_used=5)})
    assert values((await scrape(app, client))["vllm:kv_cache_usage_perc"]) == {
        ("vllm:kv_cache_usage_perc", MODEL, "n1"): 0.5
    }
    await beat(redis, "n1", {})  # unloaded

    families = await scrape(app, client)

    assert all(family.samples == [] for family in families.values())
    assert set(families) == {"vllm:kv_cache_usage_perc", *COUNTERS, *SPEC_COUNTERS}


async def test_the_tiers_below_the_device_show_their_hits_bytes_and_blocks(app, client, redis):
    kv = KVCacheStats(
        block_size=16,
        blocks_total=100,
        prefix_queries=5000,
        prefix_hits=4000,
        host_blocks_total=300,
        host_blocks_used=120,
        disk_blocks=900,
        host_hits=1500,
        disk_hits=500,
        offloaded_bytes=10 << 20,
        restored_bytes=4 << 20,
        disk_written_bytes=30 << 20,
        disk_read_bytes=2 << 20,
    )
    await beat(redis, "n1", {MODEL: ModelState.READY}, kv={MODEL: kv})
    await beat(  # no tier: no tier series
        redis, "n2", {MODEL: ModelState.READY}, kv={MODEL: KVCacheStats(block_size=16)}
    )
    ctx = app.state.ctx
    await ctx.metrics.refresh(ctx.fleet, set(ctx.catalog.profiles))
    text = (await client.get("/metrics")).text
    found = {f.name: f for f in text_string_to_metric_families(text)}

    def by(name: str, label: str) -> dict[tuple[str, str], float]:
        return {(s.labels["node"], s.labels[label]): s.value for s in found[name].samples}

    assert found["cortex:kv_cache_tier_hits"].type == "counter"
    assert by("cortex:kv_cache_tier_hits", "tier") == {
        ("n1", "device"): 2000,
        ("n1", "host"): 1500,
        ("n1", "disk"): 500,
    }
    assert by("cortex:kv_cache_tier_bytes", "copy") == {
        ("n1", "offloaded"): 10 << 20,
        ("n1", "restored"): 4 << 20,
        ("n1", "disk_written"): 30 << 20,
        ("n1", "disk_read"): 2 << 20,
    }
    assert by("cortex:kv_cache_tier_blocks", "tier") == {
        ("n1", "host_used"): 120,
        ("n1", "host_total"): 300,
        ("n1", "disk"): 900,
    }
