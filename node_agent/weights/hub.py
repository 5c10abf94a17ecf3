"""Fetch a model from a Hugging Face hub with the `huggingface_hub` client: its metadata (files,
sizes, hashes) from the model-info API, then each needed file of that commit into the model's
folder, over the client's own HTTP session. The client honours HF_ENDPOINT (a mirror) and HF_TOKEN.
Each file grows in its `.partial` file, written as it arrives (so progress shows on disk), which
outlives a failed pull: the next one resumes it with a Range request. (`hf_hub_download` would not:
it buffers 10 MB at a time and deletes its partial file when the call fails.) Blocking: run it in
a thread."""

import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx2
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from node_agent.weights import hashes
from node_agent.weights.selection import needed_files
from shared.errors import ModelPullFailed
from shared.model_store import FileEntry, HubRef, Manifest, inside, partial_path


def manifest(source: str, gguf_file: str | None) -> Manifest:
    """What the hub says `source` is made of: the files the model needs, with sizes and hashes."""
    ref = HubRef.parse(source)
    try:
        info = HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise ModelPullFailed(f"{source}: the hub's model info could not be read: {exc}") from exc
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = [
        FileEntry(
            name=name,
            size=s.size or 0,
            sha256=s.lfs.sha256 if s.lfs else "",
            blob_id=s.blob_id or "",
        )
        for name in needed_files(list(siblings), gguf_file, source)
        for s in [siblings[name]]
    ]
    return Manifest(source=source, commit=info.sha or ref.revision or "main", files=files)


def download(wanted: Manifest, folder: Path, stopping: threading.Event) -> None:
    """Each file of `wanted` into `folder`, checked against its size and hash (a bad file is deleted);
    `stopping` set ends it between two chunks (the node is shutting down)."""
    ref = HubRef.parse(wanted.source)
    for entry in wanted.files:
        target = inside(folder, entry.name)
        if not target.is_file():
            try:
                _fetch(
                    hf_hub_url(ref.repo, entry.name, revision=wanted.commit),
                    entry,
                    partial_path(folder, entry.name),
                    stopping,
                )
            except (HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
                raise ModelPullFailed(
                    f"{wanted.source}: downloading {entry.name} from the hub failed: {exc}"
                ) from exc
            target.parent.mkdir(parents=True, exist_ok=True)  # a module's subfolder (1_Pooling/)
            partial_path(folder, entry.name).rename(target)
        hashes.check(target, entry, wanted.source)


def _fetch(url: str, entry: FileEntry, partial: Path, stopping: threading.Event) -> None:
    headers = build_hf_headers()  # HF_TOKEN, the client's user agent
    found = get_hf_file_metadata(url, headers=headers)  # follows the hub's redirects
    if urlparse(found.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
    have = partial.stat().st_size if partial.exists() else 0
    if have > entry.size:
        have = 0  # not a prefix of this file: start over
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream(
        "GET", found.location, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
    ) as response:
        if response.status_code == 416:  # nothing left to send: the partial file is whole
            return
        hf_raise_for_status(response)
        with partial.open("ab" if response.status_code == 206 else "wb") as out:
            for chunk in response.iter_bytes():  # as it arrives (a size would buffer up to it)
                out.write(chunk)
                if stopping.is_set():
                    raise ModelPullFailed(
                        f"the download of {entry.name} stopped: the node is shutting down"
                    )
