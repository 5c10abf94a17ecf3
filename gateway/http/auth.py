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
from typing import Annotated

from fastapi import Depends, Request
from redis.exceptions import RedisError

from gateway.http.context import Ctx, GatewayContext
from gateway.jobs.caller import ADMIN_CALLER, ANONYMOUS_CALLER, Caller, caller_var
from shared.errors import Forbidden, Unauthorized
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


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
    short Redis outage, gateway/bus/outage.py)."""
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
    auth is off), False for the anonymous view (gateway/http/metrics_view.py); with
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
