"""What a node takes from a peer before it fetches a model's files from it (node_agent/weights/puller.py,
node_agent/weights/peer.py): the fleet secret goes only to an http(s) `file_url` on the peer's own host
(its heartbeat's `host`), and the peer's manifest is used only where it matches what this node
expects: the hub's manifest of the catalogue's source when the hub answers, else, for a source
pinned to a commit, the peer's manifest of that same commit. The folder written is the catalogue
source's, and the sizes (the disk budget's, and where a transfer stops) are the expected ones."""

import ipaddress
import socket
from urllib.parse import urlsplit

from node_agent.weights.selection import needed_files
from shared.errors import InvalidRequest, ModelPullFailed
from shared.model_store import HubRef, Manifest


def file_url_refusal(file_url: str, peer_host: str, own_host: str) -> str:
    """Why the fleet secret must not go to `file_url` (a peer's, its heartbeat naming `peer_host`);
    "" when it may: http or https, no user in it, and a host that is the peer's (by name, by a
    shared address, or loopback when the peer runs on this host). Resolves names: blocking."""
    try:
        url = urlsplit(file_url)
        where = url.hostname or ""
        url.port  # noqa: B018 (a malformed port raises here)
    except ValueError:
        return f"its file_url {file_url!r} is not a URL"
    if url.scheme not in ("http", "https") or not where or url.username or url.password:
        return f"its file_url {file_url!r} is not an http(s) URL of a host"
    if not peer_host:
        return "its heartbeat names no host"
    if where.lower() == peer_host.lower():
        return ""
    if _loopback(where):
        return (
            ""
            if peer_host.lower() == own_host.lower()
            else (f"its file_url {file_url!r} is a loopback address, and it runs on {peer_host}")
        )
    if _addresses(where) & _addresses(peer_host):
        return ""
    return f"its file_url {file_url!r} is not on its host {peer_host}"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def accepted(
    offered: Manifest, source: str, gguf_file: str | None, expected: Manifest | None
) -> Manifest:
    """The manifest to fetch `source` by from a peer that offers `offered`: `expected` (the hub's)
    when the peer's matches it file for file; the peer's own when the hub did not answer and it
    names the commit `source` pins. ModelPullFailed saying why not otherwise."""
    if offered.source != source:
        raise ModelPullFailed(f"its manifest is of {offered.source!r}, not {source!r}")
    if expected is not None:
        if offered.commit != expected.commit or _files(offered) != _files(expected):
            raise ModelPullFailed(
                f"its manifest of {source} (commit {offered.commit}) does not match the hub's "
                f"(commit {expected.commit}): other files, sizes or hashes"
            )
        return expected
    pinned = HubRef.parse(source).revision
    if not HubRef.is_commit(pinned):
        raise ModelPullFailed(
            f"the hub did not answer and {source} pins no commit, so a peer's files of it cannot be "
            "checked (pin one: hf:org/name@<40-hex commit>)"
        )
    if offered.commit != pinned:
        raise ModelPullFailed(f"its manifest is of commit {offered.commit}, {source} pins {pinned}")
    names = sorted(f.name for f in offered.files)
    try:
        wanted = needed_files(names, gguf_file, source)
    except InvalidRequest as exc:
        raise ModelPullFailed(f"its manifest of {source}: {exc.message}") from exc
    if wanted != names or not all(f.sha256 or f.blob_id for f in offered.files):
        raise ModelPullFailed(
            f"its manifest of {source} lists files the model does not need, or files without a hash"
        )
    return offered


def _files(manifest: Manifest) -> set[tuple[str, int, str, str]]:
    return {(f.name, f.size, f.sha256, f.blob_id) for f in manifest.files}
