"""Names for a conversation's prefixes that the gateway can compute without a tokenizer, and that
a node's cache can vouch for (cache-aware routing, gateway/fleet/routing.py).

A chat request's marks are a hash chain over its messages: the first names the model, the request's
cache salt (`salt`), the tools and the template's arguments with the first message; each next one
adds one message. Two requests share a mark exactly when they share every message up to it (so
turn 2 of a conversation shares turn 1's last mark). Each mark travels with the characters of the
messages up to it, from which the node estimates the tokens it spans
(node_agent/engine/engine.prefix_tokens), anchors it on the cached block that ends there, and
reports it held (`Keys.prefixes`) until that block is evicted.

In the model's prefix index (`Keys.prefix_index`), a mark a node holds reads `{tokens}` where its
blocks are on the device and `{tokens}:{tier}` where the node keeps them only below it (`host`,
`disk`: node_agent/engine/kv_tiers.py); `held` and `indexed` write and read that.
"""

import hashlib
import json

from shared.wire import GenerationRequest

MAX_MARKS = 32  # a long conversation keeps its first 2 and its last 30: where a next turn or a shared system prompt matches
DIGEST_BYTES = 12


def _canonical(value) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    ).encode()


def marks(request: GenerationRequest) -> list[tuple[str, int]]:
    """(mark, characters up to it) for each message prefix of a chat request; none for other kinds
    and for requests with images (their prompts are not cached)."""
    if request.kind != "chat" or not request.messages or request.images:
        return []
    first = [request.model, request.cache_salt, request.tools, request.chat_template_kwargs]
    chain = hashlib.blake2b(_canonical(first), digest_size=DIGEST_BYTES).digest()
    found, chars = [], 0
    for message in request.messages:
        data = _canonical(message)
        chain = hashlib.blake2b(chain + data, digest_size=DIGEST_BYTES).digest()
        chars += len(data)
        found.append((chain.hex(), chars))
    return found if len(found) <= MAX_MARKS else found[:2] + found[2 - MAX_MARKS :]


def salt(scope: str, key_name: str | None, given: str | None) -> str:
    """The salt a job's prefix blocks are hashed with (`GenerationRequest.cache_salt`): under scope
    `key` its API key's name (None for callers without one: anonymous, the admin key) with the
    request's own `cache_salt`, so one key never finds another's prompts cached (nor learns from
    `cached_tokens` what another sent); under `fleet` the request's salt alone. '' when there is
    neither: such jobs share cached prefixes, and travel as before salts existed. A hash, so neither
    shows on the wire."""
    parts = ([key_name] if scope == "key" and key_name else []) + ([given] if given else [])
    return (
        hashlib.blake2b("\0".join(parts).encode(), digest_size=DIGEST_BYTES).hexdigest()
        if parts
        else ""
    )


def session(owner: str, hint: str) -> str:
    """The name a session hint (`prompt_cache_key`, `user`, ...) is kept under: a hash, so neither the
    hint nor whose it is shows in Redis, and two API keys' equal hints stay apart."""
    return hashlib.blake2b(f"{owner}\0{hint}".encode(), digest_size=DIGEST_BYTES).hexdigest()


DEVICE = "device"


def indexed(tokens: int, tier: str = DEVICE) -> str:
    """A held mark's value in the model's prefix index."""
    return str(tokens) if tier == DEVICE else f"{tokens}:{tier}"


def held(value: bytes | str) -> tuple[int, str]:
    """(tokens, tier) of a prefix index value."""
    text = value.decode() if isinstance(value, bytes) else value
    tokens, _, tier = text.partition(":")
    return int(tokens), tier or DEVICE
