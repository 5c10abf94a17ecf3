"""The routing policy (gateway/fleet/routing.py) on a real redis-server, with heartbeats and cache
contents written as nodes write them: longest cached prefix first, then the session's last node,
room checked, the setting obeyed."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from gateway.fleet.routing import Route, Routing
from gateway.jobs.submit import session_hint
from shared import prefix_marks
from shared.fleet import Fleet
from shared.fleet_view import FleetView
from shared.heartbeat import KVCacheStats, ModelInfo, NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from shared.wire import GenerationRequest

KEYS = Keys()
MODEL = "m"
TURN = GenerationRequest(
    job="j",
    model=MODEL,
    kind="chat",
    messages=[
        {"role": "system", "content": "a long system prompt"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "why?"},
    ],
)


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def routing(r, mode: str = "cache", load_weight: float = 0.25) -> Routing:
    settings = GatewaySettings(routing=mode, routing_load_weight=load_weight)
    return Routing(r, KEYS, settings, Fleet(r, KEYS, 8))


async def beat(
    r, node: str, used: int = 0, state: ModelState = ModelState.READY, blocks_used: int = 0
) -> None:
    """A heartbeat from `node`: `used` of 4 slots taken, `blocks_used` KV blocks of 16 tokens held."""
    kv = KVCacheStats(block_size=16, blocks_total=1024, blocks_used=blocks_used)
    hb = NodeHeartbeat(
        node=node,
        version="0",
        started_ms=0,
        heartbeat_ms=int(time.time() * 1000),
        models={MODEL: ModelInfo(state=state, device="cpu", slots_total=4, slots_used=used, kv=kv)},
    )
    await r.hset(KEYS.node(node), mapping=hb.to_hash())
    await r.zadd(KEYS.nodes(), {node: hb.heartbeat_ms})


def marked() -> GenerationRequest:
    return TURN.model_copy(update={"prefix_marks": prefix_marks.marks(TURN)})


async def hold(r, node: str, request: GenerationRequest, upto: int, tier: str = "device") -> None:
    """`node`'s cache holds the request's first `upto` prefixes, on the device or only in a tier
    below it (as its CacheIndex writes them: its own hash, and the model's prefix index routing
    reads)."""
    marks = request.prefix_marks[:upto]
    await r.hset(KEYS.prefixes(MODEL, node), mapping={m: c for m, c in marks})
    await r.hset(
        KEYS.prefix_index(MODEL),
        mapping={f"{m}@{node}": prefix_marks.indexed(c, tier) for m, c in marks},
    )


async def test_the_node_holding_the_longest_prefix_with_room_gets_the_job(r):
    for node in ("n1", "n2", "n3"):
        await beat(r, node)
    request = marked()
    await hold(r, "n1", request, 1)  # the system prompt only
    await hold(r, "n3", request, 3)  # the conversation up to its last answer
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n3", "cache")
    await beat(r, "n3", used=4)  # no free slot: the node holding the next longest prefix
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")
    await beat(
        r, "n1", used=4
    )  # none with room holds any of it: the one with room, counted as `full`
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n2", "full")
    await beat(r, "n2", used=4)  # no room anywhere: the shared stream
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "full")
    await beat(r, "n3")
    for _ in range(4):  # its own stream holds as many jobs as it has slots
        await r.xadd(KEYS.node_jobs(MODEL, "n3"), {"job": "x"})
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "full")
    assert await routing(r).route(request, "", "batch", "normal") == Route(
        "n3", "cache"
    )  # another stream


async def test_a_busy_holder_is_worth_its_cached_tokens_only(r):
    request = marked()
    prompt = request.prefix_marks[-1][1]
    await hold(r, "n1", request, 4)
    await beat(r, "n2")
    # n1's running sequences hold four times the prompt's tokens, each worth a quarter of a token to
    # prefill (routing_load_weight): n1 still costs less
    await beat(r, "n1", blocks_used=4 * prompt // 16)
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")
    # more: prefilling all of it on the idle n2 is cheaper
    await beat(r, "n1", blocks_used=4 * prompt // 16 + 2)
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n2", "full")
    # weighed as Dynamo does (1), a prompt's worth of running tokens is enough
    await beat(r, "n1", blocks_used=prompt // 16 + 2)
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")
    assert await routing(r, load_weight=1).route(request, "", "interactive", "normal") == Route(
        "n2", "full"
    )


async def test_a_prefix_on_the_device_beats_one_in_host_memory_which_beats_one_on_disk(r):
    """The same prefix held three ways: copying it back from host memory or disk costs a share of
    its tokens (`TIER_COPY_COST`), so the device's holder wins, then host memory's; a longer prefix
    on disk still beats a much shorter one on the device."""
    request = marked()
    for node in ("n1", "n2", "n3"):
        await beat(r, node)
    await hold(r, "n1", request, 4, tier="disk")
    await hold(r, "n2", request, 4, tier="host")
    await hold(r, "n3", request, 4)
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n3", "cache")
    await r.delete(KEYS.prefix_index(MODEL))
    await hold(r, "n1", request, 4, tier="disk")
    await hold(r, "n2", request, 4, tier="host")
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n2", "cache")
    await r.delete(KEYS.prefix_index(MODEL))
    await hold(r, "n1", request, 4, tier="disk")
    await hold(r, "n3", request, 1)  # the system prompt alone, on the device
    assert request.prefix_marks[0][1] < 0.75 * request.prefix_marks[3][1]
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")


async def test_what_this_gateway_routed_since_a_heartbeat_counts_as_load(r):
    request = marked()
    for node in ("n1", "n2"):
        await beat(r, node)
        await hold(r, node, request, 4)
    policy = routing(r)
    await asyncio.sleep(
        0.01
    )  # times are in ms: a job routed in its heartbeat's millisecond counts as before it
    # both hold the conversation, both idle: each job routed adds its prompt to its node's load until
    # that node's next heartbeat, so a burst of them alternates
    jobs = [request.model_copy(update={"job": f"j{i}"}) for i in range(5)]
    got = [(await policy.route(job, "", "interactive", "normal")).node for job in jobs[:4]]
    assert sorted(got) == ["n1", "n1", "n2", "n2"] and got[0] != got[1]
    await beat(r, "n1")  # a heartbeat after those jobs: its KV use (idle here) replaces them
    await asyncio.sleep(0.01)
    policy._read_at = -1.0  # read the nodes again now (otherwise at most every 0.5 s)
    assert (await policy.route(jobs[4], "", "interactive", "normal")).node == "n1"
    await asyncio.sleep(0.01)  # they end a few ms after that heartbeat (times are in ms)
    for job in jobs:
        policy.ended(job.job)
    nodes = {n.node: n for n in await policy._live()}
    assert policy._since_heartbeat(nodes["n2"]) == (0, 0)  # routed after its heartbeat, and ended
    prompt = request.prefix_marks[-1][
        1
    ]  # n1's heartbeat came while two of them ran: they ended since
    assert policy._since_heartbeat(nodes["n1"]) == (-2, -2 * prompt)


async def test_a_session_goes_where_its_last_turn_ran_when_no_cache_holds_it(r):
    for node in ("n1", "n2"):
        await beat(r, node)
    session = prefix_marks.session("key", "conversation-7")
    await routing(r).ran(MODEL, session, "n2")
    assert await routing(r).route(marked(), session, "interactive", "normal") == Route(
        "n2", "session"
    )
    assert await routing(r, "session").route(TURN, session, "interactive", "normal") == Route(
        "n2", "session"
    )
    await beat(r, "n2", used=4)  # no room there: another node's
    assert await routing(r).route(marked(), session, "interactive", "normal") == Route("n1", "full")
    await beat(r, "n1", used=4)  # no room anywhere: the shared stream
    assert await routing(r).route(marked(), session, "interactive", "normal") == Route(None, "full")
    assert 0 < await r.ttl(KEYS.session(MODEL, session)) <= 3600


async def test_a_new_conversation_goes_to_the_least_busy_node(r):
    await beat(r, "n1", blocks_used=10)
    await beat(r, "n2", blocks_used=3)
    await beat(r, "n3", blocks_used=5)
    policy = routing(r)
    await asyncio.sleep(0.01)  # routed after the heartbeats' millisecond, so they count as load
    request = marked()
    assert await policy.route(request, "", "interactive", "normal") == Route("n2", "load")
    # that job's prompt (150 tokens, as its marks count) now counts on n2 until its next heartbeat, or
    # until it ends: n3 (80 tokens) is the least busy
    assert await policy.route(
        request.model_copy(update={"job": "k"}), "", "interactive", "normal"
    ) == Route("n3", "load")
    assert await routing(r, "session").route(TURN, "s", "interactive", "normal") == Route(
        "n2", "load"
    )
    assert await routing(r).route(TURN, "", "interactive", "normal") == Route(
        None, "shared"
    )  # neither marks nor session
    for node in ("n1", "n2", "n3"):
        await beat(r, node, used=4)
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "shared")


async def test_nothing_is_routed_with_routing_off_one_node_or_a_model_not_ready(r):
    await beat(r, "n1")
    request = marked()
    await hold(r, "n1", request, 4)
    assert await routing(r).route(request, "", "interactive", "normal") == Route(
        None, "shared"
    )  # one node
    await beat(r, "n2", state=ModelState.LOADING)
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "shared")
    await beat(r, "n2")
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")
    assert await routing(r, "none").route(request, "s", "interactive", "normal") == Route(
        None, "shared"
    )


def test_session_hints_in_each_dialect():
    assert session_hint(SimpleNamespace(prompt_cache_key="p", user="u")) == "p"
    assert (
        session_hint(SimpleNamespace(user="u", metadata={"user_id": "x"})) == "u"
    )  # OpenAI's metadata is free-form
    assert (
        session_hint(SimpleNamespace(metadata=SimpleNamespace(user_id="a"))) == "a"
    )  # Anthropic's
    assert session_hint(SimpleNamespace()) == ""  # nor an x-cortex-session header


async def test_a_prefix_another_key_left_cached_does_not_draw_the_job(r):
    """Under `prefix_cache_scope = key` each key's prompts are salted (shared/prefix_marks.py): the node
    holding alice's conversation is where her next turn goes, not where bob's same conversation goes."""
    for node in ("n1", "n2"):
        await beat(r, node)

    def of(key: str, scope: str = "key") -> GenerationRequest:
        salted = TURN.model_copy(update={"cache_salt": prefix_marks.salt(scope, key, None)})
        return salted.model_copy(update={"prefix_marks": prefix_marks.marks(salted)})

    await beat(r, "n1", blocks_used=8)  # busier: only a cached prefix draws a job there
    await hold(r, "n1", of("alice"), 3)
    assert await routing(r).route(of("alice"), "", "interactive", "normal") == Route("n1", "cache")
    assert await routing(r).route(of("bob"), "", "interactive", "normal") == Route("n2", "load")
    await hold(r, "n1", of("alice", "fleet"), 3)
    assert await routing(r).route(of("bob", "fleet"), "", "interactive", "normal") == Route(
        "n1", "cache"
    )


async def test_a_job_costs_the_same_few_commands_however_many_nodes_hold_its_model(r):
    """With the gateway's fleet view, routing reads no heartbeat: one HMGET of the job's marks on
    every candidate, one GET of its session, an XLEN of the best candidates' own streams."""
    request = marked()
    counts = []
    for nodes in (3, 30):
        for i in range(nodes):
            await beat(r, f"n{i}")
        await hold(r, "n1", request, 2)
        view = FleetView(r, KEYS, node_ttl_s=8.0)
        await view.start()
        try:
            router = Routing(r, KEYS, GatewaySettings(), Fleet(r, KEYS, 8, view=view))
            before = await r.info("commandstats")
            assert await router.route(request, "s", "interactive", "normal") == Route("n1", "cache")
            after = await r.info("commandstats")
        finally:
            await view.stop()
        own = ("cmdstat_info", "cmdstat_xread", "cmdstat_zrangebyscore")  # this test's, the view's
        counts.append(
            {
                k: after[k]["calls"] - before.get(k, {}).get("calls", 0)
                for k in after
                if k not in own and after[k]["calls"] != before.get(k, {}).get("calls", 0)
            }
        )
    assert counts[0] == counts[1] == {"cmdstat_hmget": 1, "cmdstat_get": 1, "cmdstat_xlen": 1}
