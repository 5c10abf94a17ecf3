"""Redis connections with retry and backoff, the same for every part."""

from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError


def connect(url: str, **kwargs) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
        **kwargs,
    )


def redact(url: str) -> str:
    """The URL with its password hidden, for log lines and messages."""
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@") if parts.password else url
