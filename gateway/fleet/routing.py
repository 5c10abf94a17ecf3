"""Cache-aware routing: which node's own job stream a job goes to, if any (TGI's split: the policy
is here, the nodes only report what their caches hold).

For each job with a conversation (chat) or a session, among the live nodes taking jobs that have
its model ready (the model's holders in the gateway's fleet view, shared/fleet_view.py: no Redis
command) and room for it (a free sequence slot in its last heartbeat, less the jobs this gateway
routed there since, and plus those it saw end; and, read for the best two only, fewer jobs on its
own stream of the job's class and band than slots). A job costs a fixed number of commands however
large the fleet: one HMGET of its marks on every candidate, one GET of its session, one or two XLEN:
1. `cache`: when some node's cache holds a prefix of the prompt (`Keys.prefix_index`, written by the
   nodes from their engines' real cache state; marks in `shared.prefix_marks`), the node where the
   job costs least, counting in tokens as NVIDIA Dynamo's KV router does: the prompt tokens its
   cache lacks (to prefill; a prefix it keeps only in host memory or on disk lacks a share of its
   tokens, the copy back: `TIER_COPY_COST`) plus `routing_load_weight` × the tokens its running sequences hold (to
   decode alongside; the heartbeat's KV blocks in use, plus the prompts this gateway routed there
   since, less those of its jobs that ended since). Dynamo weighs both alike (1); the default 0.25
   counts a token held by a running sequence as a quarter of a token to prefill, as a node with a
   free slot decodes one more sequence for much less than it prefills its prompt. When that is a
   node holding none of it (the holders are busier than the prefix is worth, or full): `full`;
2. else the node that ran the last turn of the job's session (`Keys.session`: the request's
   `prompt_cache_key`, `user`, Anthropic's `metadata.user_id` or the `x-cortex-session` header);
3. else `load`: the least busy node (fewest tokens held by running sequences, then fewest cached
   blocks it would evict), so that new conversations, whose later turns follow them, spread over
   the fleet rather than going to whichever node happens to read first.
A job goes to the chosen node's own stream; with no node with room, to the shared stream (`full`
when a node held it or ran its session, else `shared`), as do all jobs with routing `none`, jobs
with neither conversation nor session, and every job of a model with one replica. The setting
`routing` picks `cache` (1-3), `session` (2-3) or `none`. A job that waits on a node's own stream
longer than `affinity_wait_ms`, or whose node dies, drains or drops the model, is moved by the
janitor to the moved stream every node reads (gateway/fleet/janitor.py; `moved`). Counts per model and
outcome: `Keys.routing`.
"""

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import prefix_marks
from shared.fleet import Fleet
from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from shared.wire import GenerationRequest

NODES_FRESH_S = 0.5  # without a fresh fleet view, the live nodes are read at most this often
ROOM_CHECKS = 2  # the best candidates whose own stream's length is read, in order
# What copying a cached token back to the device costs, in tokens to prefill: a host-tier hit
# answered in 0.24x the time of prefilling the prompt, a restarted node's disk tier in 0.11x
# (docs/benchmarks.md, issue 52), both with the rest of the request in it; a disk read costs more
# than a host copy where the disk is not in the page cache. A prefix on the device costs nothing.
TIER_COPY_COST = {prefix_marks.DEVICE: 0.0, "host": 0.1, "disk": 0.25}


@dataclass(frozen=True)
class Route:
    node: str | None  # its own stream, or None: the shared stream
    outcome: str  # one of shared.fleet_status.ROUTING_OUTCOMES


SHARED = Route(None, "shared")
FULL = Route(None, "full")  # a node held it (or ran its session) but none had room
FORGET_AFTER_MS = (
    3_600_000  # a routed job never seen to end here (its client detached) is forgotten after this
)


@dataclass
class _Routed:
    sent_ms: int
    tokens: int  # its prompt's, as its marks count them
    ended_ms: int | None = None


def _now_ms() -> int:
    return int(time.time() * 1000)


class Routing:
    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: GatewaySettings, fleet: Fleet):
        self.redis, self.keys, self.settings, self.fleet = redis, keys, settings, fleet
        self._nodes: list[NodeHeartbeat] = []
        self._read_at = -NODES_FRESH_S
        self._lock = asyncio.Lock()
        self._routed: dict[
            str, dict[str, _Routed]
        ] = {}  # node -> job -> what this gateway routed there

    @property
    def mode(self) -> str:
        return self.settings.routing

    def prepare(self, request: GenerationRequest) -> None:
        """Name the request's prefixes, so its node reports them once they are cached."""
        if self.mode == "cache":
            request.prefix_marks = prefix_marks.marks(request)

    async def _live(self) -> list[NodeHeartbeat]:
        async with self._lock:
            if time.monotonic() - self._read_at >= NODES_FRESH_S:
                self._nodes = await self.fleet.serving_nodes()
                self._read_at = time.monotonic()
            return self._nodes

    async def _candidates(self, model: str) -> list[NodeHeartbeat]:
        """Nodes taking jobs that have `model` ready: its holders in the fleet view while the view
        is fresh (no Redis command), else the live nodes read at most every NODES_FRESH_S."""
        view = self.fleet.view
        nodes = view.holders(model) if view is not None and view.fresh else await self._live()
        return [
            n
            for n in nodes
            if n.takes_jobs
            and (info := n.models.get(model)) is not None
            and info.state == ModelState.READY
        ]

    async def route(
        self, request: GenerationRequest, session: str, job_class: str, band: str
    ) -> Route:
        """Where the job goes (see the module's docstring): one HMGET of the prompt's marks on every
        candidate (the model's prefix index), the session's last node, then the own stream's length
        of the best candidates only, at most ROOM_CHECKS of them."""
        if self.mode == "none" or not (request.prefix_marks or session):
            return SHARED
        model, keys = request.model, self.keys
        nodes = await self._candidates(model)
        if len(nodes) < 2:
            return SHARED
        marks = [mark for mark, _ in request.prefix_marks] if self.mode == "cache" else []
        async with self.redis.pipeline(transaction=False) as pipe:
            if marks:
                pipe.hmget(
                    keys.prefix_index(model), [f"{m}@{n.node}" for n in nodes for m in marks]
                )
            if session:
                pipe.get(keys.session(model, session))
            replies = await pipe.execute()
        since = {n.node: self._since_heartbeat(n) for n in nodes}
        active = {n.node: _active(n, model, since[n.node][1]) for n in nodes}
        roomy = [n for n in nodes if _has_room(n, model, since[n.node][0])]
        prompt = (
            request.prefix_marks[-1][1] if request.prefix_marks else 0
        )  # its tokens, as the marks count them
        found = replies[0] if marks else []
        held = {
            n.node: _longest(found[i * len(marks) : (i + 1) * len(marks)])
            for i, n in enumerate(nodes)
        }
        last = replies[-1].decode() if session and replies[-1] else None
        if any(held.values()):
            weight = self.settings.routing_load_weight
            outcome, cost = (
                "cache",
                lambda n: (prompt - held[n.node] + weight * active[n.node], -held[n.node]),
            )
        elif last in {n.node for n in nodes}:
            outcome, cost = "session", lambda n: (n.node != last, active[n.node])
        else:
            outcome, cost = "load", lambda n: (active[n.node], _cached_blocks(n, model))
        best = await self._with_short_stream(
            sorted(roomy, key=cost)[:ROOM_CHECKS], request.job, prompt, model, job_class, band
        )
        if best is None:
            return SHARED if outcome == "load" else FULL
        if (outcome == "cache" and not held[best.node]) or (
            outcome == "session" and best.node != last
        ):
            outcome = "full"  # a node with room that holds none of it costs less (or the session's has none)
        return Route(best.node, outcome)

    async def _with_short_stream(
        self,
        ranked: list[NodeHeartbeat],
        job: str,
        prompt: int,
        model: str,
        job_class: str,
        band: str,
    ) -> NodeHeartbeat | None:
        """The first of `ranked` whose own stream of the job's class and band holds fewer jobs than
        it has slots (one XLEN each, in order), with the job counted there: counted before the XLEN,
        so that jobs routed meanwhile see it (and taken back if the stream is full)."""
        for node in ranked:
            routed = self._routed.setdefault(node.node, {})
            routed[job] = _Routed(_now_ms(), prompt)
            queued = await self.redis.xlen(self.keys.node_jobs(model, node.node, job_class, band))
            if queued < node.models[model].slots_total:
                return node
            routed.pop(job, None)
        return None

    def _since_heartbeat(self, node: NodeHeartbeat) -> tuple[int, int]:
        """What changed on `node` since its last heartbeat, as far as this gateway knows: (sequences,
        prompt tokens) routed there since that have not ended, less those routed before it that
        ended since (the heartbeat still counts them)."""
        jobs, beat, old = (
            self._routed.get(node.node, {}),
            node.heartbeat_ms,
            _now_ms() - FORGET_AFTER_MS,
        )
        sequences = tokens = 0
        for job, routed in list(jobs.items()):
            ended = routed.ended_ms
            if (ended is not None and ended <= beat) or (ended is None and routed.sent_ms < old):
                del jobs[
                    job
                ]  # ended before the heartbeat (which no longer counts it), or long forgotten
            elif routed.sent_ms > beat and ended is None:
                sequences, tokens = sequences + 1, tokens + routed.tokens
            elif routed.sent_ms <= beat and ended is not None:
                sequences, tokens = sequences - 1, tokens - routed.tokens
        return sequences, tokens

    def ended(self, job: str) -> None:
        """The job ended here (done, failed or cancelled): its node's load no longer counts it."""
        for jobs in self._routed.values():
            if job in jobs:
                jobs[job].ended_ms = _now_ms()

    async def ran(self, model: str, session: str, node: str) -> None:
        """The session's last turn ran on `node`: its next goes there too (`session_ttl_s`)."""
        await self.redis.set(
            self.keys.session(model, session), node, ex=self.settings.session_ttl_s
        )


def _longest(found: list[bytes | None]) -> float:
    """What the longest prefix a node holds saves, in prompt tokens (its marks' replies, in the
    request's order): a prefix kept below the device saves its tokens less what copying them back
    costs (`TIER_COPY_COST`)."""
    saved = 0.0
    for value in found:
        if value is not None:
            tokens, tier = prefix_marks.held(value)
            saved = max(saved, tokens * (1 - TIER_COPY_COST.get(tier, 1.0)))
    return saved


def _active(node: NodeHeartbeat, model: str, tokens_since: int) -> int:
    """Tokens `node`'s running sequences of `model` hold: its last heartbeat's KV blocks in use,
    corrected by the prompt tokens this gateway routed there, or saw end, since (`_since_heartbeat`)."""
    kv = node.models[model].kv
    return max(0, (kv.blocks_used * kv.block_size if kv else 0) + tokens_since)


def _has_room(node: NodeHeartbeat, model: str, sequences_since: int) -> bool:
    """A free sequence slot (its heartbeat's, corrected as in `_active`); its own stream's length is
    checked for the best candidates only (`Routing._with_short_stream`)."""
    info = node.models[model]
    return max(0, info.slots_used + sequences_since) < info.slots_total


def _cached_blocks(node: NodeHeartbeat, model: str) -> int:
    """Free KV blocks holding reusable prefixes: between two idle nodes, a new conversation goes to
    the one it would evict less from."""
    kv = node.models[model].kv
    return kv.blocks_cached if kv else 0
