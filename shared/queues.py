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

Fair shares between callers (API keys; `admin` and `anonymous` are one each): a job for a shared
stream that already holds a job nobody has read, or for any stream of a band whose rooms hold jobs
(a node's own stream too: a full fleet serves callers in turn before caches), waits instead in its
caller's waiting room (`Keys.waiting_room`), and the band's list of rooms holding jobs (`Keys.waiting_keys`) is served
round-robin: a node that has read every unread entry of the band's streams takes the first room's
oldest job, moves it onto the shared stream and reads it there (so from then on it is an ordinary
entry, acknowledged, recovered and requeued as any), and puts the room at the back of the list.
A caller with 1,000 jobs waiting therefore delays another caller's one job by at most one job per
caller with jobs waiting, not by 1,000. Nor need it wait for a slot: while rooms hold jobs, each
replica takes up to `newcomer_slots` jobs beyond its slots, each from the room of a caller with no
job running on it (most urgent band first; the engine preempts a sequence of the caller holding the
most rows to make it a row), and a room that was empty and gets a job is announced on
`Keys.newcomers` (the model's name), which wakes the full replicas (node_agent/serving/job_reader.py). A job goes straight to the shared stream when that has no
unread entry and no room of the band holds jobs (an idle fleet: no extra step); that entry also
wakes a node blocked on the streams, and the node takes the rooms' jobs on its next read.
"""

import functools
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
    return list(_streams(keys, model, classes, tuple(nodes)))


@functools.lru_cache(maxsize=8192)  # every gateway asks for every model's every 2 s (its metrics)
def _streams(
    keys: Keys, model: str, classes: tuple[str, ...], nodes: tuple[str, ...]
) -> tuple[tuple[str, str], ...]:
    return tuple(
        (c, s)
        for c in classes
        for b in BANDS
        for s in [
            *(keys.node_jobs(model, n, c, b) for n in nodes),
            keys.moved_jobs(model, c, b),
            keys.jobs(model, c, b),
        ]
    )


def rings(keys: Keys, model: str, classes: tuple[str, ...] = CLASSES) -> list[tuple[str, str]]:
    """(class, `Keys.waiting_keys`) of `model`'s bands, most urgent first, as `streams` orders them."""
    return [(c, keys.waiting_keys(model, c, b)) for c in classes for b in BANDS]


@dataclass(frozen=True)
class StreamName:
    """What a job stream's key says: its model, class, band and whose it is (`node`: a node's own
    stream; `moved`: the moved stream; `tenant`: a caller's waiting room; none: the shared stream)."""

    model: str
    job_class: str
    band: str
    node: str | None = None
    moved: bool = False
    tenant: str | None = None


def parse(keys: Keys, stream: str) -> StreamName | None:
    """The parts of a job stream or waiting room key (None for a key that is neither)."""
    for head in (keys.all_jobs()[:-1], keys.all_waiting()[:-1]):
        if stream.startswith(head):
            break
    else:
        return None
    rest, model, node, moved, tenant = stream[len(head) :], None, None, False, None
    if keys.cluster:  # jobs:{model}:suffix
        if not rest.startswith("{") or "}" not in rest:
            return None
        model, rest = rest[1:].split("}", 1)
    if ":@" in rest:
        rest, node = rest.rsplit(":@", 1)
    elif ":~" in rest:
        rest, tenant = rest.rsplit(":~", 1)
    elif rest.endswith(":moved"):
        rest, moved = rest[: -len(":moved")], True
    for c in CLASSES:
        for b in BANDS:
            suffix = keys.stream_suffix(c, b)
            if suffix and rest.endswith(suffix):
                found = model if model is not None else rest[: -len(suffix)]
                return StreamName(found, c, b, node, moved, tenant)
    found = model if model is not None else rest
    return StreamName(found, "interactive", "normal", node, moved, tenant)


def homes(stream: str) -> list[str]:
    """Where a job queued on `stream` may wait: there, and for a node's own stream also the moved
    stream the janitor moves it to (under the same entry id, unless a later id was moved first)."""
    return [stream, Keys.moved_of(stream)] if ":@" in stream else [stream]


def is_waiting_room(stream: str) -> bool:
    """Whether a job's key is a waiting room (`Keys.waiting_room`) rather than a stream nodes read."""
    return ":~" in stream and ":@" not in stream


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
local function is_rooms(key)
  return redis.call('TYPE', key).ok == 'list'
end
local function rooms(ring)
  return redis.call('LRANGE', ring, 0, -1)
end
local function waiting(key, group)
  if is_rooms(key) then
    local n = 0
    for _, room in ipairs(rooms(key)) do n = n + redis.call('XLEN', room) end
    return n
  end
  local len = redis.call('XLEN', key)
  if len == 0 then return 0 end
  local n = pending(key, group)
  return math.max(len - n, 0)
end
"""

# KEYS: streams, then lists of waiting rooms (`rings`); ARGV[1]: group, ARGV[2]: the first list's
# place in KEYS. Returns {now_ms, {unread, pending, oldest unread id or ''} per key} (for a list of
# rooms: the jobs in its rooms, 0, the oldest). An empty stream (most of a fleet's own streams) costs
# one XLEN, a list without rooms one LRANGE.
QUEUE_STATS_LUA = (
    LUA_PENDING
    + """
local t = redis.call('TIME')
local first_ring = tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local unread, n, oldest = 0, 0, ''
  if i >= first_ring then
    for _, room in ipairs(rooms(key)) do
      unread = unread + redis.call('XLEN', room)
      local r = redis.call('XRANGE', room, '-', '+', 'COUNT', 1)
      if r[1] and (oldest == '' or before(r[1][1], oldest)) then oldest = r[1][1] end
    end
  else
    local len = redis.call('XLEN', key)
    if len > 0 then
      local maxp
      n, maxp = pending(key, ARGV[1])
      if len > n then
        local r = redis.call('XRANGE', key, maxp and ('(' .. maxp) or '-', '+', 'COUNT', 1)
        if r[1] then oldest = r[1][1] end
      end
      unread = math.max(len - n, 0)
    end
  end
  out[i] = {unread, n, oldest}
end
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), out}
"""
)

# KEYS[1]: the job's stream or waiting room; KEYS[2..]: streams (and lists of waiting rooms) nodes
# read before it, and for a waiting room last its list of rooms. ARGV: entry id, group, cap on
# counting, '1' to withdraw the entry if nobody has read it yet, '1' when KEYS[1] is a waiting room.
# Returns 0 once a node has read the entry (or it is gone); else its position (1 = next), or 1
# when it was withdrawn. A job in a waiting room with n jobs of its caller before it comes after
# at most n + 1 of each other caller's waiting in the band (round-robin: about, not exactly).
QUEUE_POSITION_LUA = (
    LUA_PENDING
    + """
local id = ARGV[1]
if #redis.call('XRANGE', KEYS[1], id, id) == 0 then return 0 end
if ARGV[5] == '1' then
  local ring = KEYS[#KEYS]
  if ARGV[4] == '1' then
    redis.call('XDEL', KEYS[1], id)
    if redis.call('XLEN', KEYS[1]) == 0 then
      redis.call('DEL', KEYS[1])
      redis.call('LREM', ring, 0, KEYS[1])
    end
    return 1
  end
  local mine = #redis.call('XRANGE', KEYS[1], '-', '(' .. id, 'COUNT', tonumber(ARGV[3]))
  local ahead = mine
  for _, room in ipairs(rooms(ring)) do
    if room ~= KEYS[1] then ahead = ahead + math.min(redis.call('XLEN', room), mine + 1) end
  end
  for i = 2, #KEYS - 1 do ahead = ahead + waiting(KEYS[i], ARGV[2]) end
  return ahead + 1
end
local n, maxp = pending(KEYS[1], ARGV[2])
if maxp and not before(maxp, id) then return 0 end
if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], id) return 1 end
local ahead = #redis.call('XRANGE', KEYS[1], maxp and ('(' .. maxp) or '-', '(' .. id, 'COUNT', tonumber(ARGV[3]))
for i = 2, #KEYS do ahead = ahead + waiting(KEYS[i], ARGV[2]) end
return ahead + 1
"""
)

# KEYS[1]: the stream the job is for (shared, or a node's own); KEYS[2]: its caller's waiting room;
# KEYS[3]: the band's list of rooms; KEYS[4..]: the moved and shared streams and lists of rooms of
# the job's class (what counts as waiting for `limit`). ARGV: group, MAXLEN ~ of the stream, limit
# (0: none), '1' when KEYS[1] is the shared stream (a node's own stream takes the job unless rooms
# of its band hold jobs), the newcomers' channel and the model (a room that was empty gets a job:
# PUBLISH the model there), then the entry's fields and values. Returns {key, entry id} where the job was queued, or {'', jobs
# waiting} when more than `limit` jobs of the class were waiting already (nothing is written).
SUBMIT_LUA = (
    LUA_PENDING
    + """
local group, limit = ARGV[1], tonumber(ARGV[3])
if limit > 0 then
  local n = 0
  for i = 4, #KEYS do n = n + waiting(KEYS[i], group) end
  if n > limit then return {'', n} end
end
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
if redis.call('EXISTS', KEYS[3]) == 1 or (ARGV[4] == '1' and waiting(KEYS[1], group) > 0) then
  if redis.call('XLEN', KEYS[2]) == 0 then
    redis.call('RPUSH', KEYS[3], KEYS[2])
    redis.call('PUBLISH', ARGV[5], ARGV[6])  -- a newcomer: wakes the full replicas
  end
  return {KEYS[2], redis.call('XADD', KEYS[2], '*', unpack(fields))}
end
return {KEYS[1], redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))}
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
    stream_pairs = streams(keys, model, nodes=nodes)
    pairs = stream_pairs + rings(keys, model)
    reply = await redis.register_script(QUEUE_STATS_LUA)(
        keys=[s for _, s in pairs], args=[CONSUMER_GROUP, len(stream_pairs) + 1]
    )
    return summarize(model, [c for c, _ in pairs], reply, replicas)


def streams_before(keys: Keys, stream: str) -> list[str]:
    """The streams (and lists of waiting rooms) of its model that are read before `stream`: the more
    urgent bands', and a node's own stream of the band before the shared one (for a node's own
    stream, as that node reads them); for a waiting room, its band's streams, then its list of rooms
    last (QUEUE_POSITION_LUA's order)."""
    name = parse(keys, stream)
    if name is None:
        return []
    nodes = (name.node,) if name.node is not None else ()
    ordered = [
        key
        for (_, ring), band_streams in zip(
            rings(keys, name.model), _by_band(keys, name.model, nodes)
        )
        for key in [*band_streams, ring]
    ]
    if name.tenant is not None:
        ring = keys.waiting_keys(name.model, name.job_class, name.band)
        return [*ordered[: ordered.index(ring)], ring]
    return ordered[: ordered.index(stream)] if stream in ordered else []


def _by_band(
    keys: Keys, model: str, nodes: tuple[str, ...] = (), classes: tuple[str, ...] = CLASSES
) -> list[list[str]]:
    """`streams` of `model`, one list per band."""
    per_band = len(nodes) + 2
    ordered = [s for _, s in streams(keys, model, classes, nodes)]
    return [ordered[i : i + per_band] for i in range(0, len(ordered), per_band)]


def class_waiting(keys: Keys, model: str, job_class: str) -> list[str]:
    """What counts as waiting for SUBMIT_LUA's limit: the moved and shared streams and the lists of
    waiting rooms of `model`'s bands of `job_class` (nodes' own streams hold at most a node's slots)."""
    classes = (job_class,)
    return [
        key
        for (_, ring), band_streams in zip(
            rings(keys, model, classes), _by_band(keys, model, (), classes)
        )
        for key in [*band_streams, ring]
    ]


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
