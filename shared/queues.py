"""Priority classes and the job streams that carry them.

A stream cannot skip entries, so each model has one stream per (class, band), and nodes read
them most urgent first (`node_agent.serving.job_reader`):

| class         | band   | stream                          | who                                  |
|---------------|--------|---------------------------------|--------------------------------------|
| `interactive` | high   | `cortex:jobs:{model}:interactive:high` | API requests with `priority` < 0 |
| `interactive` | normal | `cortex:jobs:{model}`           | API requests (the default)           |
| `interactive` | low    | `cortex:jobs:{model}:interactive:low`  | API requests with `priority` > 0  |
| `batch`       | high / normal / low | `cortex:jobs:{model}:batch[:high/:low]` | `/v1/batches` lines |

`priority` follows vLLM's convention (lower is sooner, default 0); within a band jobs are FIFO.

Each of these has two neighbours of the same class and band (cache-aware routing, gateway/fleet/routing.py):
a node's own stream (`:@{node}`), for jobs routed to the node whose cache holds their prefix, which
only that node reads, before the rest of the band; and the moved stream (`:moved`), for jobs that
left an own stream unserved (their node was full for `affinity_wait_ms`, or is gone), which every
node reads beside the shared stream, the older entry first, so a moved job keeps its place.
"""

from dataclasses import dataclass

from shared.keys import CONSUMER_GROUP, Keys

CLASSES = ("interactive", "batch")  # most urgent first
BANDS = ("high", "normal", "low")


def band(priority: int | None) -> str:
    """The band of a per-request `priority` (lower is sooner)."""
    if not priority:
        return "normal"
    return "high" if priority < 0 else "low"


def streams(
    keys: Keys, model: str, classes: tuple[str, ...] = CLASSES, nodes: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """(class, stream key) for the streams of `model` in the order a node reads them: by class and
    band, most urgent first, and within a band the own streams of `nodes` (`Keys.node_jobs`), then
    the moved stream, then the shared one (a node takes the moved and shared streams oldest first)."""
    return [
        (c, s)
        for c in classes
        for b in BANDS
        for s in [
            *(keys.node_jobs(model, n, c, b) for n in nodes),
            keys.moved_jobs(model, c, b),
            keys.jobs(model, c, b),
        ]
    ]


@dataclass(frozen=True)
class StreamName:
    """What a job stream's key says: its model, class, band and whose it is (`node`: a node's own
    stream; `moved`: the moved stream; neither: the shared stream)."""

    model: str
    job_class: str
    band: str
    node: str | None = None
    moved: bool = False


def parse(keys: Keys, stream: str) -> StreamName | None:
    """The parts of a job stream key (None for a key that is not a job stream)."""
    head = keys.all_jobs()[:-1]
    if not stream.startswith(head):
        return None
    rest, model, node, moved = stream[len(head) :], None, None, False
    if keys.cluster:  # jobs:{model}:suffix
        if not rest.startswith("{") or "}" not in rest:
            return None
        model, rest = rest[1:].split("}", 1)
    if ":@" in rest:
        rest, node = rest.rsplit(":@", 1)
    elif rest.endswith(":moved"):
        rest, moved = rest[: -len(":moved")], True
    for c in CLASSES:
        for b in BANDS:
            suffix = keys.stream_suffix(c, b)
            if suffix and rest.endswith(suffix):
                return StreamName(
                    model if model is not None else rest[: -len(suffix)], c, b, node, moved
                )
    return StreamName(model if model is not None else rest, "interactive", "normal", node, moved)


def homes(stream: str) -> list[str]:
    """Where a job queued on `stream` may wait: there, and for a node's own stream also the moved
    stream the janitor moves it to (under the same entry id, unless a later id was moved first)."""
    return [stream, Keys.moved_of(stream)] if ":@" in stream else [stream]


def model_of(keys: Keys, stream: str) -> str | None:
    """The model a job stream key belongs to (None for a key that is not a job stream)."""
    name = parse(keys, stream)
    return name.model if name else None


def entry_ms(entry_id: str | bytes) -> int:
    """The Redis server time (ms) at which an auto-id entry was added."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


# ---- reading queues (gateway `/v1/queue`, `cortex status`, queue positions) --------------------

# Nodes XACK and XDEL an entry in one round trip when its job ends, so a stream holds exactly the
# entries nobody has read (after the group's last pending entry) plus the pending ones.
LUA_PENDING = """
local function pending(key, group)
  local p = redis.pcall('XPENDING', key, group)
  if type(p) ~= 'table' or p.err or p[1] == 0 then return 0, nil end
  return p[1], p[3]
end
local function before(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
"""

# KEYS: streams; ARGV[1]: group. Returns {now_ms, {unread, pending, oldest unread id or ''} per stream}.
QUEUE_STATS_LUA = (
    LUA_PENDING
    + """
local t = redis.call('TIME')
local out = {}
for i, key in ipairs(KEYS) do
  local len = redis.call('XLEN', key)
  local n, maxp = pending(key, ARGV[1])
  local oldest = ''
  if len > n then
    local r = redis.call('XRANGE', key, maxp and ('(' .. maxp) or '-', '+', 'COUNT', 1)
    if r[1] then oldest = r[1][1] end
  end
  out[i] = {math.max(len - n, 0), n, oldest}
end
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), out}
"""
)

# KEYS[1]: the job's stream; KEYS[2..]: streams nodes read before it. ARGV: entry id, group,
# cap on counting, '1' to withdraw the entry if nobody has read it yet.
# Returns 0 once a node has read the entry (or it is gone); else its position (1 = next), or 1
# when it was withdrawn.
QUEUE_POSITION_LUA = (
    LUA_PENDING
    + """
local id = ARGV[1]
if #redis.call('XRANGE', KEYS[1], id, id) == 0 then return 0 end
local n, maxp = pending(KEYS[1], ARGV[2])
if maxp and not before(maxp, id) then return 0 end
if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], id) return 1 end
local ahead = #redis.call('XRANGE', KEYS[1], maxp and ('(' .. maxp) or '-', '(' .. id, 'COUNT', tonumber(ARGV[3]))
for i = 2, #KEYS do
  local m = pending(KEYS[i], ARGV[2])
  ahead = ahead + redis.call('XLEN', KEYS[i]) - m
end
return ahead + 1
"""
)


# KEYS[1]: a node's own stream; KEYS[2]: the moved stream of its class and band. ARGV: group, the
# newest entry id to move (ms; '+': all), the most to move, '1' to delete the own stream once empty.
# Moves the entries nobody has read, oldest first, each under its own id where the moved stream
# allows (else just after the moved stream's last id), so it keeps its place. Returns how many moved.
MOVE_LUA = (
    LUA_PENDING
    + """
local n, maxp = pending(KEYS[1], ARGV[1])
local entries = redis.call('XRANGE', KEYS[1], maxp and ('(' .. maxp) or '-', ARGV[2], 'COUNT', tonumber(ARGV[3]))
for _, e in ipairs(entries) do
  local added = redis.pcall('XADD', KEYS[2], e[1], unpack(e[2]))
  if type(added) == 'table' and added.err then
    local info = redis.call('XINFO', 'STREAM', KEYS[2])
    local last
    for i = 1, #info, 2 do if info[i] == 'last-generated-id' then last = info[i + 1] end end
    local ms, seq = string.match(last, '(%d+)-(%d+)')
    redis.call('XADD', KEYS[2], ms .. '-' .. (tonumber(seq) + 1), unpack(e[2]))
  end
  redis.call('XDEL', KEYS[1], e[1])
end
if ARGV[4] == '1' and redis.call('XLEN', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
return #entries
"""
)


async def depth(
    redis, keys: Keys, model: str, replicas: int = 0, nodes: tuple[str, ...] = ()
) -> dict:
    """One model's `/v1/queue` entry (`summarize`) from an asyncio client: what is really waiting
    (entries no node has read, counted from the streams, not the group's `lag`, which deletions
    can leave stale) and running; with the own streams of `nodes`."""
    pairs = streams(keys, model, nodes=nodes)
    reply = await redis.register_script(QUEUE_STATS_LUA)(
        keys=[s for _, s in pairs], args=[CONSUMER_GROUP]
    )
    return summarize(model, [c for c, _ in pairs], reply, replicas)


def streams_before(keys: Keys, stream: str) -> list[str]:
    """The streams of its model that are read before `stream`: the more urgent ones, and a node's own
    stream of the band before the shared one (for a node's own stream, as that node reads them)."""
    name = parse(keys, stream)
    if name is None:
        return []
    ordered = [
        s for _, s in streams(keys, name.model, nodes=(name.node,) if name.node is not None else ())
    ]
    return ordered[: ordered.index(stream)] if stream in ordered else []


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def summarize(model: str, classes: list[str], reply: list, replicas: int = 0) -> dict:
    """QUEUE_STATS_LUA's reply for `streams(keys, model)` → the `/v1/queue` entry of one model."""
    now_ms, per_stream = int(reply[0]), reply[1]
    queued = dict.fromkeys(CLASSES, 0)
    oldest_wait_s: dict[str, float | None] = dict.fromkeys(CLASSES, None)
    running = 0
    for job_class, (unread, pending, oldest) in zip(classes, per_stream):
        queued[job_class] += int(unread)
        running += int(pending)
        if oldest:
            wait_s = max(0.0, (now_ms - entry_ms(_text(oldest))) / 1000)
            oldest_wait_s[job_class] = max(wait_s, oldest_wait_s[job_class] or 0.0)
    waits = [w for w in oldest_wait_s.values() if w is not None]
    return {
        "model": model,
        "queued": queued,
        "running": running,
        "replicas": replicas,
        "oldest_wait_s": round(max(waits), 3) if waits else None,
        "oldest_wait_s_by_class": {
            c: (round(w, 3) if w is not None else None) for c, w in oldest_wait_s.items()
        },
    }
