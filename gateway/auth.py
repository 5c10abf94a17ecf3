"""Who is calling: an API key, the admin key, or nobody (auth off).

Clients send their key as `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>`
(Anthropic). Auth is off, and requests with no key or any key run as `anonymous`, only while no
API key exists, the gateway listens on loopback and `CORTEX_REQUIRE_API_KEYS` is false; the
README's two-command set-up needs nothing more. Otherwise a missing, unknown, revoked or expired
key is a 401. The admin key (`CORTEX_ADMIN_KEY`) counts only as `Authorization: Bearer <key>`:
it may use every model without limits and sees every file and batch.
"""

import hmac
import ipaddress
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from redis.exceptions import RedisError

from gateway.context import Ctx, GatewayContext
from shared.api_keys import ADMIN, ANONYMOUS, ApiKey
from shared.catalog import ModelProfile
from shared.errors import Forbidden, ModelNotAllowed, Unauthorized
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

caller_var: ContextVar[str] = ContextVar("caller", default="-")  # the key's name, for log lines


@dataclass(frozen=True)
class Caller:
    name: str  # the key's name, `admin` or `anonymous`
    key: ApiKey | None = None  # None: admin or anonymous, which no limit applies to

    @property
    def owner(self) -> str | None:
        """Whose files and batches the caller sees: its own, or (admin) everyone's (None)."""
        return None if self.name == ADMIN else self.name

    def may_use(self, names: set[str]) -> bool:
        """Whether the caller may use the model with these names (its id and aliases)."""
        return self.key is None or self.key.may_use(names)

    def check_may_use(self, profile: ModelProfile) -> None:
        """401 if the key was revoked or expired since (a batch runs for a while), 404/403 if it may
        not use the model."""
        if self.key is None:
            return
        if (state := self.key.state()) != "active":
            raise Unauthorized(
                f"API key {self.name!r} ({self.key.hint}…) is {state}; ask an operator for another"
            )
        if not self.may_use({profile.id, *profile.aliases}):
            raise ModelNotAllowed(
                f"The model `{profile.id}` does not exist or API key {self.name!r} may not use it",
                param="model",
            )


ADMIN_CALLER, ANONYMOUS_CALLER = Caller(ADMIN), Caller(ANONYMOUS)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _is_admin(settings: GatewaySettings, token: str | None) -> bool:
    return bool(settings.admin_key and token) and hmac.compare_digest(
        token.encode(), settings.admin_key.encode()
    )


async def auth_required(ctx: GatewayContext) -> bool:
    settings = ctx.settings
    return (
        settings.require_api_keys
        or not is_loopback(settings.host)
        or await ctx.api_keys.any_exist()
    )


async def identify(ctx: GatewayContext, request: Request) -> Caller:
    token = bearer(request)
    if _is_admin(ctx.settings, token):
        return ADMIN_CALLER
    secret = token or request.headers.get("x-api-key", "").strip() or None
    key = await ctx.api_keys.find(secret) if secret else None
    if key is not None:
        if (state := key.state()) != "active":
            raise Unauthorized(
                f"API key {key.name!r} ({key.hint}…) is {state}; ask an operator for another"
            )
        return Caller(key.name, key)
    if not await auth_required(ctx):
        return ANONYMOUS_CALLER
    if secret is None:
        raise Unauthorized(
            "no API key was sent: send Authorization: Bearer <key> (OpenAI) or x-api-key: <key> "
            "(Anthropic); an operator creates keys with `cortex keys create`"
        )
    raise Unauthorized("Incorrect API key provided; an operator lists keys with `cortex keys list`")


async def authenticate(request: Request, ctx: Ctx) -> Caller:
    """The dependency every /v1 route runs: the caller, or a 401 in the route's dialect (waiting out a
    short Redis outage, gateway/outage.py)."""
    caller = await ctx.outage.through(lambda: identify(ctx, request))
    caller_var.set(caller.name)
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]


def require_admin(request: Request, ctx: Ctx) -> None:
    """The admin API's dependency: only `Authorization: Bearer <CORTEX_ADMIN_KEY>`."""
    if not ctx.settings.admin_key:
        raise Forbidden("the admin API is disabled: set CORTEX_ADMIN_KEY on the gateway")
    if not _is_admin(ctx.settings, bearer(request)):
        raise Unauthorized("a valid admin key is required (Authorization: Bearer <key>)")


async def require_dashboard(request: Request, ctx: Ctx) -> None:
    """The dashboard's data: open while auth is off (loopback, no key exists), else the admin key's."""
    if await auth_required(ctx):
        require_admin(request, ctx)


async def metrics_access(request: Request, ctx: Ctx) -> bool:
    """`/metrics`' dependency: True when the caller sees every series (the admin key, or anyone while
    auth is off), False for the anonymous view (gateway/metrics_view.py); with
    `metrics_require_admin_key`, anyone but the admin key is refused (401, or 403 without one set)."""
    if _is_admin(ctx.settings, bearer(request)):
        return True
    if ctx.settings.metrics_require_admin_key:
        require_admin(request, ctx)
    return not await auth_required(ctx)


async def warn_if_exposed(ctx: GatewayContext) -> None:
    """At start: say loudly when the gateway listens beyond loopback with no key to let anyone in."""
    settings = ctx.settings
    try:
        keys_exist = await ctx.api_keys.any_exist()
    except RedisError as exc:
        log.warning("could not check whether API keys exist (%s); each request checks again", exc)
        return
    if not keys_exist:
        if not is_loopback(settings.host) or settings.require_api_keys:
            log.warning(
                "\n%s\nNO API KEY EXISTS and the gateway requires one (it listens on %s%s): every /v1 request "
                "is refused with 401 until an operator creates a key, e.g.\n    cortex keys create --name NAME "
                "[--models a,b] [--rpm N] [--tpm N] [--max-tokens-per-day N] [--expires 30d]\n"
                "(run it with the gateway's CORTEX_REDIS_URL; the key works on every replica at once)\n%s",
                "!" * 100,
                settings.host,
                ", CORTEX_REQUIRE_API_KEYS is set" if settings.require_api_keys else "",
                "!" * 100,
            )
        else:
            log.info(
                "auth is off: no API key exists and the gateway listens on loopback (%s)",
                settings.host,
            )
