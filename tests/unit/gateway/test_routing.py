"""The routing policy (gateway/routing.py) on a real redis-server, with heartbeats and cache
contents written as nodes write them: longest cached prefix first, then the session's last node,
room checked, the setting obeyed."""

import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from gateway.routing import Route, Routing, session_hint
from shared import prefix_marks
from shared.fleet import Fleet
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from shared.wire import GenerationRequest

KEYS = Keys()
MODEL = "m"
TURN = GenerationRequest(job="j", model=MODEL, kind="chat", messages=[
    {"role": "system", "content": "a long system prompt"}, {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"}, {"role": "user", "content": "why?"}])


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def routing(r, mode: str = "cache") -> Routing:
    ctx = SimpleNamespace(settings=GatewaySettings(routing=mode), keys=KEYS, redis=r, fleet=Fleet(r, KEYS, 8))
    return Routing(ctx)


async def beat(r, node: str, used: int = 0, state: ModelState = ModelState.READY) -> None:
    hb = NodeHeartbeat(node=node, version="0", started_ms=0, heartbeat_ms=int(time.time() * 1000),
                       models={MODEL: ModelInfo(state=state, device="cpu", slots_total=4, slots_used=used)})
    await r.hset(KEYS.node(node), mapping=hb.to_hash())
    await r.zadd(KEYS.nodes(), {node: hb.heartbeat_ms})


def marked() -> GenerationRequest:
    return TURN.model_copy(update={"prefix_marks": prefix_marks.marks(TURN)})


async def hold(r, node: str, request: GenerationRequest, upto: int) -> None:
    """`node`'s cache holds the request's first `upto` prefixes."""
    await r.hset(KEYS.prefixes(MODEL, node), mapping={m: c for m, c in request.prefix_marks[:upto]})


async def test_the_node_holding_the_longest_prefix_with_room_gets_the_job(r):
    for node in ("n1", "n2", "n3"):
        await beat(r, node)
    request = marked()
    await hold(r, "n1", request, 1)  # the system prompt only
    await hold(r, "n3", request, 3)  # the conversation up to its last answer
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n3", "cache")
    await beat(r, "n3", used=4)  # no free slot: the shared stream, counted as `full`
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "full")
    await beat(r, "n3")
    for _ in range(4):  # its own stream holds as many jobs as it has slots
        await r.xadd(KEYS.node_jobs(MODEL, "n3"), {"job": "x"})
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "full")
    assert await routing(r).route(request, "", "batch", "normal") == Route("n3", "cache")  # another stream


async def test_a_session_goes_where_its_last_turn_ran_when_no_cache_holds_it(r):
    for node in ("n1", "n2"):
        await beat(r, node)
    session = prefix_marks.session("key", "conversation-7")
    await routing(r).ran(MODEL, session, "n2")
    assert await routing(r).route(marked(), session, "interactive", "normal") == Route("n2", "session")
    assert await routing(r, "session").route(TURN, session, "interactive", "normal") == Route("n2", "session")
    assert await routing(r).route(marked(), "", "interactive", "normal") == Route(None, "shared")
    assert 0 < await r.ttl(KEYS.session(MODEL, session)) <= 3600


async def test_nothing_is_routed_with_routing_off_one_node_or_a_model_not_ready(r):
    await beat(r, "n1")
    request = marked()
    await hold(r, "n1", request, 4)
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "shared")  # one node
    await beat(r, "n2", state=ModelState.LOADING)
    assert await routing(r).route(request, "", "interactive", "normal") == Route(None, "shared")
    await beat(r, "n2")
    assert await routing(r).route(request, "", "interactive", "normal") == Route("n1", "cache")
    assert await routing(r, "none").route(request, "s", "interactive", "normal") == Route(None, "shared")


def test_session_hints_in_each_dialect():
    assert session_hint(SimpleNamespace(prompt_cache_key="p", user="u")) == "p"
    assert session_hint(SimpleNamespace(user="u", metadata={"user_id": "x"})) == "u"  # OpenAI's metadata is free-form
    assert session_hint(SimpleNamespace(metadata=SimpleNamespace(user_id="a"))) == "a"  # Anthropic's
    assert session_hint(SimpleNamespace()) == ""  # nor an x-cortex-session header
