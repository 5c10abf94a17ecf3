"""Reads a model's job streams most urgent first (shared/queues.py): interactive before batch,
and within a class the high band, then normal, then low.

One Lua script reads them in that order in one round trip, as many entries as there are free
slots; batch entries may take at most `batch_free` of them (the node keeps
`interactive_reserved_slots` for interactive arrivals). Starvation is bounded: a stream whose
next entry has waited longer than `batch_max_wait_s` gets one entry read ahead of the rest. When
every stream is empty the reader blocks on all of them (XREADGROUP BLOCK), so a new job is
taken within a round trip of its XADD.

All of a model's stream I/O on the node is here: the consumer group on each stream, the reads,
the backlog read when a load failed, leaving the group on unload, and settling entries Redis still
holds for this node that it no longer runs. Acknowledging a finished job rides on the step's
pipeline (node_agent/serving/publisher.py)."""

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import queues
from shared.keys import CONSUMER_GROUP, Keys

BLOCK_MS = 1000
CAPPED_BLOCK_MS = 50  # batch may take no slot now; read again soon, for when one of its jobs ends

# KEYS: streams, most urgent first. ARGV: group, consumer, wanted, then per stream: cap, max wait ms
# (0: never promoted). Returns {stream, entry id, {field, value, ...}} per entry, in admission order.
_READ = """
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local caps, waits, out = {}, {}, {}
for i = 1, #KEYS do caps[i] = tonumber(ARGV[2 + 2 * i]); waits[i] = tonumber(ARGV[3 + 2 * i]) end
local function take(i, n)
  n = math.min(n, want, caps[i])
  if n <= 0 then return end
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', KEYS[i], '>')
  if not r then return end
  for _, e in ipairs(r[1][2]) do out[#out + 1] = {KEYS[i], e[1], e[2]} end
  want, caps[i] = want - #r[1][2], caps[i] - #r[1][2]
end
local function next_unread_ms(key)
  local p = redis.pcall('XPENDING', key, group)
  local start = '-'
  if type(p) == 'table' and not p.err and p[1] > 0 then start = '(' .. p[3] end
  local r = redis.call('XRANGE', key, start, '+', 'COUNT', 1)
  if not r[1] then return nil end
  return tonumber(string.match(r[1][1], '^(%d+)'))
end
for i = 1, #KEYS do
  if waits[i] > 0 and want > 0 and caps[i] > 0 then
    local ms = next_unread_ms(KEYS[i])
    if ms and now - ms > waits[i] then take(i, 1) end
  end
end
for i = 1, #KEYS do take(i, want) end
return out
"""


@dataclass
class Entry:
    stream: str
    entry_id: str
    job_class: str
    fields: dict[bytes, bytes]


class JobReader:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, consumer: str, batch_max_wait_s: float):
        self.redis, self.consumer = redis, consumer
        self.streams = queues.streams(keys, model)  # (class, stream), most urgent first
        self.class_of = {stream: job_class for job_class, stream in self.streams}
        self.batch_max_wait_ms = int(batch_max_wait_s * 1000)
        self._read = redis.register_script(_READ)

    async def ensure_groups(self) -> None:
        """Create the group `agents` on every stream of the model (and the streams), where missing."""
        for _job_class, stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def backlog(self, count: int = 100) -> list[Entry]:
        """Up to `count` unread entries of any stream, without blocking (empty: none left)."""
        reply = await self.redis.xreadgroup(CONSUMER_GROUP, self.consumer, {s: ">" for _, s in self.streams},
                                            count=count)
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
                entries = await self.redis.xpending_range(stream, CONSUMER_GROUP, min="-", max="+", count=10_000,
                                                          consumername=self.consumer)
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

    async def read(self, free: int, batch_free: int) -> list[Entry]:
        """Up to `free` entries (at most `batch_free` of them batch), most urgent first; blocks up
        to BLOCK_MS when there are none."""
        args: list = [CONSUMER_GROUP, self.consumer, free]
        for job_class, _ in self.streams:
            batch = job_class == "batch"
            args += [batch_free if batch else free, self.batch_max_wait_ms if batch else 0]
        reply = await self._read(keys=[s for _, s in self.streams], args=args)
        if reply:
            return [self._entry(stream, entry_id, flat) for stream, entry_id, flat in reply]
        readable = [s for c, s in self.streams if c != "batch" or batch_free > 0]
        count = min(free, batch_free) if batch_free > 0 else free
        blocked = await self.redis.xreadgroup(CONSUMER_GROUP, self.consumer, dict.fromkeys(readable, ">"),
                                              count=count, block=BLOCK_MS if batch_free > 0 else CAPPED_BLOCK_MS)
        return self._entries(blocked)

    def _entries(self, reply) -> list[Entry]:
        return [Entry(stream.decode(), entry_id.decode(), self.class_of[stream.decode()], fields)
                for stream, entries in reply or [] for entry_id, fields in entries]

    def _entry(self, stream: bytes, entry_id: bytes, flat: list[bytes]) -> Entry:
        fields = dict(zip(flat[::2], flat[1::2]))
        return Entry(stream.decode(), entry_id.decode(), self.class_of[stream.decode()], fields)
