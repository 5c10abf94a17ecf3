"""API keys, kept in Redis so every gateway replica and the `cortex keys` CLI see the same ones.

A key's secret (`sk-cortex-…`) is shown once, when it is created; Redis keeps only its SHA-256
(`cortex:apikeys`: hash → name) and the key's record (`cortex:apikey:{name}`): what it may use,
its limits, when it expires or was revoked, and its usage counters. Keys are never deleted, so a
revoked key's secret is still recognised (and refused as revoked) and its usage stays readable.
"""

import hashlib
import json
import re
import secrets
import time
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, field_validator

from shared.errors import Conflict, InvalidRequest, NotFound
from shared.keys import Keys

SECRET_PREFIX = "sk-cortex-"
HINT_CHARS = len(SECRET_PREFIX) + 4  # how much of the secret the record keeps, to recognise it
ADMIN, ANONYMOUS = (
    "admin",
    "anonymous",
)  # the callers that are not keys; no key may take these names
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# KEYS[1] the key's record, KEYS[2] the secret index; ARGV: the secret's hash, the key's name,
# then the record's fields and values. Returns 0 if a key of that name exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


def utc_day(now_s: float | None = None) -> str:
    """The day a key's daily tokens count on (`YYYY-MM-DD`, UTC)."""
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now_s is None else now_s))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_duration_s(text: str) -> float:
    """`30d`, `12h`, `90m`, `45s`, `2w` or plain seconds → seconds."""
    match = _DURATION.match(text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise InvalidRequest(
            f"expires must be a positive duration such as 30d, 12h, 90m; got {text!r}",
            param="expires",
        )
    return float(match[1]) * _UNIT_S[match[2]]


class KeySpec(BaseModel):
    """What `cortex keys create` and `POST /admin/keys` take. A limit of 0 means no limit."""

    model_config = {"extra": "forbid"}

    name: str
    models: list[str] = []  # catalogue ids or aliases; empty: every model
    rpm: int = Field(0, ge=0)  # requests per minute
    tpm: int = Field(0, ge=0)  # tokens (prompt + completion) per minute
    max_tokens_per_day: int = Field(0, ge=0)  # tokens per UTC day
    expires: str | None = None  # a duration from now: 30d, 12h ...

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(
                "letters, digits, '.', '_' and '-', at most 64, starting with a letter or digit"
            )
        if name in (ADMIN, ANONYMOUS):
            raise ValueError(f"{name!r} is reserved")
        return name

    @field_validator("models")
    @classmethod
    def _models(cls, models: list[str]) -> list[str]:
        return [m.strip() for m in models if m.strip()]


class ApiKey(BaseModel):
    """One key's record (`cortex:apikey:{name}`), never its secret."""

    name: str
    hash: str = Field(exclude=True)  # SHA-256 of the secret; not shown by the CLI or the admin API
    hint: str  # the secret's first characters, e.g. `sk-cortex-Ab3x`
    models: list[str] = []
    rpm: int = 0
    tpm: int = 0
    max_tokens_per_day: int = 0
    created_ms: int
    expires_ms: int = 0  # 0: never
    revoked_ms: int = 0  # 0: not revoked
    # usage, counted by the gateways
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejections: int = 0
    tokens_today: int = 0  # from `cortex:usage:{name}:{today}`, the daily budget's counter

    @field_validator("models", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, (str, bytes)) else value

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> "ApiKey":
        return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})

    def to_hash(self) -> dict[str, str]:
        fields = self.model_dump(
            exclude={"requests", "prompt_tokens", "completion_tokens", "rejections", "tokens_today"}
        )
        return {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in fields.items()} | {
            "hash": self.hash
        }

    def state(self, now_ms: int | None = None) -> Literal["active", "revoked", "expired"]:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if self.revoked_ms:
            return "revoked"
        return "expired" if self.expires_ms and now_ms >= self.expires_ms else "active"

    def may_use(self, names: set[str]) -> bool:
        """`names`: a model's id and aliases."""
        return not self.models or bool(names & set(self.models))

    def shown(self) -> dict:
        """The record as the CLI and the admin API show it."""
        return self.model_dump() | {"state": self.state()}


NAMES_KEPT = 100_000  # secrets' names a store keeps (past it, it starts again)


class KeyStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys
        self._create = redis.register_script(_CREATE)
        self._names: dict[str, str] = {}  # a secret's hash -> the name of its key, once found

    async def create(self, spec: KeySpec) -> tuple[ApiKey, str]:
        """A new key and its secret (which nothing keeps: show it to the operator once)."""
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        now_ms = int(time.time() * 1000)
        expires_ms = now_ms + int(parse_duration_s(spec.expires) * 1000) if spec.expires else 0
        key = ApiKey(
            name=spec.name,
            hash=hash_secret(secret),
            hint=secret[:HINT_CHARS],
            models=spec.models,
            rpm=spec.rpm,
            tpm=spec.tpm,
            max_tokens_per_day=spec.max_tokens_per_day,
            created_ms=now_ms,
            expires_ms=expires_ms,
        )
        fields = [part for pair in key.to_hash().items() for part in pair]
        created = await self._create(
            keys=[self.keys.api_key(key.name), self.keys.api_keys()],
            args=[key.hash, key.name, *fields],
        )
        if not created:
            raise Conflict(f"an API key named {key.name!r} exists already", param="name")
        return key, secret

    async def get(self, name: str) -> ApiKey:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.api_key(name))
            pipe.get(self.keys.daily_tokens(name, utc_day()))
            fields, today = await pipe.execute()
        if not fields:
            raise NotFound(f"no API key named {name!r}", param="name")
        return ApiKey.from_hash(fields).model_copy(update={"tokens_today": int(today or 0)})

    async def find(self, secret: str) -> ApiKey | None:
        """The key whose secret this is, revoked and expired ones included; None if none. The name a
        secret maps to is kept once found (a key is never deleted, only revoked), so a request reads
        only the key's record and its day's tokens, in one round trip; a record whose hash is not
        the secret's (a key made again under that name after Redis lost its data) is not its key."""
        hashed = hash_secret(secret)
        name = self._names.get(hashed)
        if name is None:
            found = await self.redis.hget(self.keys.api_keys(), hashed)
            if found is None:
                return None
            name = found.decode()
        try:
            key = await self.get(name)
        except NotFound:
            key = None
        if key is None or key.hash != hashed:
            self._names.pop(hashed, None)
            return None
        if len(self._names) >= NAMES_KEPT:
            self._names.clear()
        self._names[hashed] = name
        return key

    async def list(self) -> list[ApiKey]:
        names = sorted(n.decode() for n in await self.redis.hvals(self.keys.api_keys()))
        return [await self.get(name) for name in names]

    async def any_exist(self) -> bool:
        return bool(await self.redis.exists(self.keys.api_keys()))

    async def revoke(self, name: str) -> ApiKey:
        key = await self.get(name)
        if not key.revoked_ms:
            await self.redis.hset(
                self.keys.api_key(name), "revoked_ms", str(int(time.time() * 1000))
            )
        return await self.get(name)
