"""Per-key limits, shared by every gateway replica: each decision is one Lua script, run atomically
by Redis on Redis's clock, so two replicas admitting requests for one key at once see each other.

- requests per minute: a sliding window (`cortex:ratelimit:{key}:requests`, one member per
  admitted request in the last 60 s); a request is admitted while fewer than `rpm` are in it.
- tokens per minute: a sliding window of ended jobs' real usage (`…:tokens`, members
  `{job}:{tokens}`); a request is admitted while the last 60 s used fewer than `tpm` tokens.
- tokens per day: `cortex:usage:{key}:{YYYY-MM-DD}` (UTC), admitted while below the budget.

Token counts are only known when a job ends, and the node that ends it counts them
(shared/usage_meter.py: finished, failed or cancelled alike), so the one request that crosses a
token limit finishes; the next ones wait. A refusal carries how long until a request would be admitted.
"""

import logging
import time
import uuid

import redis.asyncio as aioredis

from gateway.metrics import Metrics
from gateway.tracing import request_id_var
from shared.api_keys import ApiKey, utc_day
from shared.errors import DailyBudgetExceeded, RateLimited, TokensRateLimited
from shared.keys import Keys
from shared.usage_meter import REDIS_NOW_LUA

log = logging.getLogger(__name__)


# KEYS: 1 the key's record, 2 its requests window, 3 its tokens window, 4 today's tokens.
# ARGV: 1 rpm, 2 tpm, 3 tokens per day (0: no limit), 4 ms to the end of the day, 5 a unique member.
# Returns {'ok', 0} (admitted and counted) or {'requests' | 'tokens' | 'daily', ms to wait}.
ADMIT_LUA = (
    REDIS_NOW_LUA
    + """
local window = 60000
local function refuse(reason, wait_ms)
  redis.call('HINCRBY', KEYS[1], 'rejections', 1)
  return {reason, math.max(1, wait_ms)}
end
local per_day = tonumber(ARGV[3])
if per_day > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= per_day then
  return refuse('daily', tonumber(ARGV[4]))
end
local tpm = tonumber(ARGV[2])
if tpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
  local used = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  local total = 0
  for i = 1, #used, 2 do total = total + tonumber(string.match(used[i], ':(%d+)$')) end
  if total >= tpm then
    local i = 1
    while total >= tpm do
      total = total - tonumber(string.match(used[i], ':(%d+)$'))
      i = i + 2
    end
    return refuse('tokens', tonumber(used[i - 1]) + window - now)
  end
end
local rpm = tonumber(ARGV[1])
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
  local count = redis.call('ZCARD', KEYS[2])
  if count >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[2], count - rpm, count - rpm, 'WITHSCORES')
    return refuse('requests', tonumber(oldest[2]) + window - now)
  end
  redis.call('ZADD', KEYS[2], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], window)
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
return {'ok', 0}
"""
)

_REFUSALS = {
    "requests": (RateLimited, "requests per minute", "rpm"),
    "tokens": (TokensRateLimited, "tokens per minute", "tpm"),
    "daily": (DailyBudgetExceeded, "tokens per day (UTC)", "max_tokens_per_day"),
}


def ms_to_end_of_day(now_s: float | None = None) -> int:
    now_s = time.time() if now_s is None else now_s
    return int((86400 - now_s % 86400) * 1000)


class Limiter:
    def __init__(self, redis: aioredis.Redis, keys: Keys, metrics: Metrics):
        self.keys, self.metrics = keys, metrics
        self._admit = redis.register_script(ADMIT_LUA)

    async def admit(self, key: ApiKey) -> None:
        """Count one request against `key`, or raise the limit it is over (429 with Retry-After)."""
        name = key.name
        verdict, wait_ms = await self._admit(
            keys=[
                self.keys.api_key(name),
                self.keys.rate_window(name, "requests"),
                self.keys.rate_window(name, "tokens"),
                self.keys.daily_tokens(name, utc_day()),
            ],
            args=[key.rpm, key.tpm, key.max_tokens_per_day, ms_to_end_of_day(), uuid.uuid4().hex],
        )
        verdict = verdict.decode()
        if verdict == "ok":
            self.metrics.key_requests.labels(name).inc()
            return
        self.metrics.key_rejections.labels(name, verdict).inc()
        error, what, setting = _REFUSALS[verdict]
        refusal = error(
            f"API key {name!r} is over its limit of {getattr(key, setting)} {what} ({setting})",
            retry_after_s=int(wait_ms) / 1000,
        )
        log.info("request=%s key=%s refused (429): %s", request_id_var.get(), name, refusal.message)
        raise refusal
