"""Reads a model's job streams most urgent first (shared/queues.py): interactive before batch,
and within a class the high band, then normal, then low; within a band this node's own stream
first (jobs routed here for its cache, gateway/fleet/routing.py), then the moved and shared streams,
whichever's next entry is older, then the callers' waiting rooms round-robin (fair shares between
API keys: each job taken from a room is moved onto the shared stream and read there, in the same
script; shared/queues.py).

One Lua script reads them in that order in one round trip, as many entries as there are free
slots; batch entries may take at most `batch_free` of them (the node keeps
`interactive_reserved_slots` for interactive arrivals). While callers' jobs wait in waiting
rooms, a replica also takes up to `newcomer_slots` jobs beyond its slots, each the oldest job of a
room whose caller has nothing running here (a newcomer: one caller's flood fills every slot, and
another caller's first job still starts at its next step, the engine preempting a sequence of the
caller holding the most rows: node_agent/engine/scheduler.Share). A full replica does not block on
the streams (a newcomer's job goes to its room, which no blocked read sees): it waits for the
model's newcomers' announcement (`Keys.newcomers`) or a freed slot. Starvation is bounded: a band
whose next entry has waited longer than `batch_max_wait_s` gets one entry read ahead of the rest.
When every stream is empty the reader blocks on all of them (XREADGROUP BLOCK), so a new job is
taken within a round trip of its XADD. An idle reader whose block ran out with nothing blocks again
without the script (a job reaches a waiting room only while its shared stream holds an entry nobody
has read, which a reader blocked on that stream would have been handed: nothing the script reads
can have changed), and runs it again at least every SCRIPT_EVERY_S: an idle replica costs Redis one
XREADGROUP a second, not the script's ~30 commands (at 1,000 replicas, 30,000 commands a second).

All of a model's stream I/O on the node is here: the consumer group on each stream, the reads,
the own streams' backlog read when a load failed, leaving the group on unload, and settling entries Redis still
holds for this node that it no longer runs. Acknowledging a finished job rides on the step's
pipeline (node_agent/serving/publisher.py)."""

import random
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import queues
from shared.keys import CONSUMER_GROUP, Keys

BLOCK_MS = 1000
SCRIPT_EVERY_S = 10.0  # an idle reader's longest run of blocking reads without the read script
CAPPED_BLOCK_MS = 50  # batch may take no slot now; read again soon, for when one of its jobs ends
STREAMS_PER_BAND = 3  # own, moved, shared (queues.streams with this node)

# KEYS: per band, most urgent first, its three streams: this node's own, the moved one, the shared one;
# then per band its list of waiting rooms (`Keys.waiting_keys`).
# ARGV: group, consumer, wanted, the interactive cap, the batch cap, then per band: its class (1:
# interactive, 2: batch) and its max wait ms (0: never promoted); then the newcomers' slots (taken
# beyond `wanted`, interactive only), the model's newcomers' channel and its name (a room a newcomer's
# job was taken from that holds more is announced again there), and the callers with a job running here.
# Returns {1 if any room holds jobs else 0, {stream, entry id, {field, value, ...}} per entry, in
# admission order, the newcomers' last; how many of them are newcomers'}.
_READ = (
    queues.LUA_PENDING
    + """
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local caps = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local bands = #KEYS / 4
local running = {}
for i = 9 + 2 * bands, #ARGV do running[ARGV[i]] = true end
local contended = false
for g = 1, bands do
  if redis.call('EXISTS', KEYS[3 * bands + g]) == 1 then contended = true end
end
local kept = contended and tonumber(ARGV[6 + 2 * bands]) or 0
local function head(key)
  if redis.call('XLEN', key) == 0 then return nil end
  local _, maxp = pending(key, group)
  local r = redis.call('XRANGE', key, maxp and ('(' .. maxp) or '-', '+', 'COUNT', 1)
  if r[1] then return r[1][1] end
  return nil
end
local function read(key, n)
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
  if not r then return 0 end
  for _, e in ipairs(r[1][2]) do out[#out + 1] = {key, e[1], e[2]} end
  return #r[1][2]
end
-- a room's oldest job moved onto the shared stream and read there: {entries read, jobs left in the room}
local function from_room(room, shared)
  local e = redis.call('XRANGE', room, '-', '+', 'COUNT', 1)[1]
  local k = 0
  if e then
    redis.call('XDEL', room, e[1])
    redis.call('XADD', shared, '*', unpack(e[2]))
    k = read(shared, 1)
  end
  local left = redis.call('XLEN', room)
  if left == 0 then redis.call('DEL', room) end
  return k, left
end
local function from_rooms(ring, shared, n)
  local got = 0
  while got < n do
    local room = redis.call('LPOP', ring)
    if not room then break end
    local k, left = from_room(room, shared)
    if left > 0 then redis.call('RPUSH', ring, room) end
    got = got + k
  end
  return got
end
local function take(g, n)
  local c = tonumber(ARGV[4 + 2 * g])
  n = math.min(n, want, caps[c])
  if n <= 0 then return end
  local moved, shared = KEYS[3 * g - 1], KEYS[3 * g]
  local got = read(KEYS[3 * g - 2], n)
  while got < n do
    local m = head(moved)
    if m == nil then
      got = got + read(shared, n - got)
      break
    end
    local s = head(shared)
    local k = read((s == nil or before(m, s)) and moved or shared, 1)
    if k == 0 then break end
    got = got + k
  end
  if got < n then got = got + from_rooms(KEYS[3 * bands + g], shared, n - got) end
  want, caps[c] = want - got, caps[c] - got
end
for g = 1, bands do
  local c, wait = tonumber(ARGV[4 + 2 * g]), tonumber(ARGV[5 + 2 * g])
  if wait > 0 and want > 0 and caps[c] > 0 then
    local oldest, key
    for i = 3 * g - 2, 3 * g do
      local h = head(KEYS[i])
      if h and (oldest == nil or before(h, oldest)) then oldest, key = h, KEYS[i] end
    end
    local ring = KEYS[3 * bands + g]
    local room = redis.call('LINDEX', ring, 0)
    local r = room and redis.call('XRANGE', room, '-', '+', 'COUNT', 1)[1]
    if r and (oldest == nil or before(r[1], oldest)) then oldest, key = r[1], ring end
    if oldest and now - tonumber(string.match(oldest, '^(%d+)')) > wait then
      local k = key == ring and from_rooms(ring, KEYS[3 * g], 1) or read(key, 1)
      want, caps[c] = want - k, caps[c] - k
    end
  end
end
for g = 1, bands do take(g, want) end
-- the newcomers' slots: the oldest job of each room whose caller runs nothing here, most urgent band
-- first (interactive only, and only where the shared stream has nothing unread: it is read first)
local newcomers = #out
for g = 1, bands do
  local ring, shared = KEYS[3 * bands + g], KEYS[3 * g]
  if kept > 0 and caps[1] > 0 and tonumber(ARGV[4 + 2 * g]) == 1 and head(shared) == nil then
    for _, room in ipairs(redis.call('LRANGE', ring, 0, -1)) do
      if kept <= 0 then break end
      local tenant = string.match(room, ':~(.*)$')
      if not running[tenant] then
        local k, left = from_room(room, shared)
        kept, caps[1], running[tenant] = kept - k, caps[1] - k, true
        if left == 0 then
          redis.call('LREM', ring, 1, room)
        else  -- its next job is a newcomer's for the other replicas: wake them
          redis.call('PUBLISH', ARGV[7 + 2 * bands], ARGV[8 + 2 * bands])
        end
      end
    end
  end
end
return {contended and 1 or 0, out, #out - newcomers}
"""
)


@dataclass
class Entry:
    stream: str
    entry_id: str
    job_class: str
    fields: dict[bytes, bytes]
    newcomer: bool = False  # taken beyond the replica's slots, for a caller with no job here


class JobReader:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, model: str, consumer: str, batch_max_wait_s: float
    ):
        self.redis, self.consumer, self.model = redis, consumer, model
        self.newcomers_channel = keys.newcomers(model)
        self.streams = queues.streams(keys, model, nodes=(consumer,))  # (class, stream), as read
        self.class_of = {stream: job_class for job_class, stream in self.streams}
        self.rings = [ring for _, ring in queues.rings(keys, model)]  # waiting rooms, per band
        self.batch_max_wait_ms = int(batch_max_wait_s * 1000)
        self._read = redis.register_script(_READ)
        self._idle_since: float | None = None  # monotonic time of the script that found nothing
        # a share of SCRIPT_EVERY_S of its own: replicas idle since the same moment do not all run
        # the script in the same second
        self._script_share = random.uniform(0.5, 1.0)
        self.full = False  # the last read had no free slot (only the newcomers' could take a job)

    async def ensure_groups(self) -> None:
        """Create the group `agents` on every stream of the model (and the streams), where missing."""
        for _job_class, stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def own_backlog(self, count: int = 100) -> list[Entry]:
        """Up to `count` unread entries of this node's own streams (jobs routed here alone), without
        blocking (empty: none left). The moved and shared streams are the fleet's: not read here."""
        own = {s: ">" for s in self.streams[::STREAMS_PER_BAND] for s in [s[1]]}
        reply = await self.redis.xreadgroup(CONSUMER_GROUP, self.consumer, own, count=count)
        return self._entries(reply)

    async def leave(self) -> None:
        """Leave the group on every stream (the model is unloaded here)."""
        for _job_class, stream in self.streams:
            try:
                await self.redis.xgroup_delconsumer(stream, CONSUMER_GROUP, self.consumer)
            except ResponseError:  # no such stream or group: nothing to leave
                pass

    async def pending(self) -> list[tuple[str, str]]:
        """(stream, entry id) of every entry Redis has delivered to this node and not seen acknowledged."""
        found = []
        for _job_class, stream in self.streams:
            try:
                entries = await self.redis.xpending_range(
                    stream,
                    CONSUMER_GROUP,
                    min="-",
                    max="+",
                    count=10_000,
                    consumername=self.consumer,
                )
            except ResponseError:  # no such stream or group
                continue
            found += [(stream, entry["message_id"].decode()) for entry in entries]
        return found

    async def settle(self, entries: list[tuple[str, str]]) -> None:
        """Acknowledge and delete entries whose jobs ended here (their acks were lost)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, entry_id in entries:
                pipe.xack(stream, CONSUMER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def read(
        self, free: int, batch_free: int, newcomers: int = 0, tenants: set[str] = frozenset()
    ) -> list[Entry]:
        """Up to `free` entries (at most `batch_free` of them batch), most urgent first, and while
        callers' jobs wait in waiting rooms up to `newcomers` more, each of a caller not in `tenants`
        (those with a job running here; `Entry.newcomer`); blocks up to BLOCK_MS when there are none,
        unless no slot is free (`full`: wait for a newcomer's announcement or a freed slot instead).
        A stream deleted meanwhile (the janitor removes the own streams of a node it thought gone),
        before the read or under the blocked one (Redis then answers UNBLOCKED), is made again."""
        try:
            return await self._read_streams(free, batch_free, newcomers, tenants)
        except (RedisError, OSError) as exc:
            # Redis away or restarted, or streams gone: what waits is not known
            self._idle_since = None
            regroup = isinstance(exc, ResponseError) and str(exc).startswith(
                ("NOGROUP", "UNBLOCKED")
            )
            if not regroup:
                raise
        await self.ensure_groups()
        return await self._read_streams(free, batch_free, newcomers, tenants)

    async def _read_streams(
        self, free: int, batch_free: int, newcomers: int = 0, tenants: set[str] = frozenset()
    ) -> list[Entry]:
        self.full = free <= 0
        idle = self._idle_since is not None and batch_free > 0
        if (
            self.full
            or not idle
            or time.monotonic() - self._idle_since >= SCRIPT_EVERY_S * self._script_share
        ):
            entries, contended = await self._run_script(free, batch_free, newcomers, tenants)
            if entries:
                self._idle_since = None
                return entries
            if self.full:  # a newcomer's job is announced (`Keys.newcomers`), not blocked on
                return []
            # rooms hold jobs: a new one is added to a room, which no blocked read is handed
            self._idle_since = None if contended or batch_free <= 0 else time.monotonic()
        readable = [s for c, s in self.streams if c != "batch" or batch_free > 0]
        count = min(free, batch_free) if batch_free > 0 else free
        blocked = await self.redis.xreadgroup(
            CONSUMER_GROUP,
            self.consumer,
            dict.fromkeys(readable, ">"),
            count=count,
            block=BLOCK_MS if batch_free > 0 else CAPPED_BLOCK_MS,
        )
        if blocked:
            self._idle_since = None
        return self._entries(blocked)

    async def _run_script(
        self, free: int, batch_free: int, newcomers: int, tenants: set[str]
    ) -> tuple[list[Entry], bool]:
        """The read script's entries (the newcomers' marked), and whether any waiting room held jobs."""
        free = max(free, 0)
        args: list = [CONSUMER_GROUP, self.consumer, free, free + newcomers, batch_free]
        for job_class, _ in self.streams[::STREAMS_PER_BAND]:
            batch = job_class == "batch"
            args += [2 if batch else 1, self.batch_max_wait_ms if batch else 0]
        args += [newcomers, self.newcomers_channel, self.model, *sorted(tenants)]
        contended, reply, taken = await self._read(
            keys=[*(s for _, s in self.streams), *self.rings], args=args
        )
        entries = [self._entry(stream, entry_id, flat) for stream, entry_id, flat in reply or []]
        for entry in entries[len(entries) - taken :] if taken else []:
            entry.newcomer = True
        return entries, bool(contended)

    def _entries(self, reply) -> list[Entry]:
        return [
            Entry(stream.decode(), entry_id.decode(), self.class_of[stream.decode()], fields)
            for stream, entries in reply or []
            for entry_id, fields in entries
        ]

    def _entry(self, stream: bytes, entry_id: bytes, flat: list[bytes]) -> Entry:
        fields = dict(zip(flat[::2], flat[1::2]))
        return Entry(stream.decode(), entry_id.decode(), self.class_of[stream.decode()], fields)
