"""Counting a job's tokens against its API key's budgets where the job ends: the node that ends it
(finished, failed or cancelled, whoever still listens) adds `charge` to the round trip that
acknowledges its entry (node_agent/serving/publisher.py). So what a client that left, or a job that
failed, consumed counts too, and a job that a node lost and another ran again counts once (its
`Keys.metered` marker). The gateway's admission (gateway/jobs/limits.py) reads the same keys:

- tokens per minute: `Keys.rate_window(key, "tokens")`, members `{job}:{tokens}` scored by Redis time;
- tokens per day: `Keys.daily_tokens(key, day)` (UTC), kept `DAY_TTL_S`;
- the key's usage counters (`prompt_tokens`, `completion_tokens` in `Keys.api_key`)."""

from shared.api_keys import utc_day
from shared.keys import Keys
from shared.wire import Usage

DAY_TTL_S = 2 * 86400  # a day's counter outlives its day, for `cortex keys show`
WINDOW_MS = 60_000

REDIS_NOW_LUA = (
    "local t = redis.call('TIME') "
    "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
)

# KEYS: 1 the key's record, 2 its tokens window, 3 today's tokens, 4 the job's "metered" marker.
# ARGV: 1 prompt tokens, 2 completion tokens, 3 the job id, 4 the day counter's TTL in seconds,
# 5 the marker's TTL. Returns the tokens counted, or -1 when the marker says they were already.
CHARGE_LUA = (
    REDIS_NOW_LUA
    + """
if not redis.call('SET', KEYS[4], '1', 'NX', 'EX', ARGV[5]) then return -1 end
local total = tonumber(ARGV[1]) + tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[2])
redis.call('INCRBY', KEYS[3], total)
redis.call('EXPIRE', KEYS[3], ARGV[4])
if total > 0 then
  redis.call('ZADD', KEYS[2], now, ARGV[3] .. ':' .. total)
  redis.call('PEXPIRE', KEYS[2], 60000)
end
return total
"""
)


def charge(pipe, keys: Keys, key: str, job: str, usage: Usage, once_ttl_s: int) -> None:
    """Queue on `pipe` (one reply: the tokens counted, or -1 if they were already) the count of
    `usage` against API key `key` for `job`; the marker that makes it once lives `once_ttl_s`."""
    pipe.eval(
        CHARGE_LUA,
        4,
        keys.api_key(key),
        keys.rate_window(key, "tokens"),
        keys.daily_tokens(key, utc_day()),
        keys.metered(job),
        usage.prompt_tokens,
        usage.completion_tokens,
        job,
        DAY_TTL_S,
        once_ttl_s,
    )
