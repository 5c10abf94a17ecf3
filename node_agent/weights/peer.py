"""Fetch a model folder from a peer node's file server (node_agent/weights/file_server.py): each file
of the manifest this node accepted (node_agent/weights/peer_trust.py), resumed from its `.partial`
file with a Range request, never past the size the manifest gives it, then checked against its
size and hash."""

from pathlib import Path

import httpx

from node_agent.weights import hashes
from shared.errors import ModelPullFailed
from shared.model_store import FileEntry, HubRef, Manifest, inside, partial_path

TIMEOUT = httpx.Timeout(30.0, connect=5.0)


async def download(wanted: Manifest, folder: Path, base_url: str, secret: str, peer: str) -> None:
    name = HubRef.parse(wanted.source).folder
    headers = {"authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as client:
        for entry in wanted.files:
            target = inside(folder, entry.name)
            if target.is_file() and target.stat().st_size == entry.size:
                continue  # fetched whole before an interruption (checked again below)
            partial = partial_path(folder, entry.name)
            have = partial.stat().st_size if partial.exists() else 0
            try:
                await _fetch(client, f"{base_url}/files/{name}/{entry.name}", partial, have, entry)
            except httpx.HTTPError as exc:
                raise ModelPullFailed(
                    f"{wanted.source}: fetching {entry.name} from {peer} failed: {exc}"
                ) from exc
            target.parent.mkdir(parents=True, exist_ok=True)  # a module's subfolder (1_Pooling/)
            partial.rename(target)
        for entry in wanted.files:
            hashes.check(folder / entry.name, entry, f"{wanted.source} (from {peer})")


async def _fetch(
    client: httpx.AsyncClient, url: str, partial: Path, have: int, entry: FileEntry
) -> None:
    headers = {"range": f"bytes={have}-"} if have else {}
    async with client.stream("GET", url, headers=headers) as response:
        if response.status_code == 416:  # nothing left past what we have
            return
        response.raise_for_status()
        written = have if response.status_code == 206 else 0
        with partial.open("ab" if response.status_code == 206 else "wb") as out:
            async for chunk in response.aiter_bytes():  # as it arrives
                written += len(chunk)
                if written > entry.size:  # a peer sending more than the file holds
                    raise ModelPullFailed(
                        f"{entry.name}: the peer sent more than its {entry.size} bytes"
                    )
                out.write(chunk)
