"""A Hugging Face hub on loopback for tests, run as its own process (`python -m tests.hub_server`):
the routes and headers the `huggingface_hub` client uses to download, over repos published into
`--root` by `publish` (each file's bytes on disk, its metadata in `{org}/{name}.meta.json`, so a
test can change a file's bytes on the server and the hub still announces the original's hash).

- `GET /api/models/{org}/{name}[/revision/{rev}]`: model info with `sha` and `siblings`
  (`rfilename`, and with `blobs=true` `size`, `blobId`, `lfs` {`sha256`, `size`, `pointerSize`});
- `HEAD|GET /{org}/{name}/resolve/{rev}/{file}`: `X-Repo-Commit`, `ETag` (the sha256 of an LFS file,
  as `X-Linked-Etag` too, with `X-Linked-Size`; a git blob id otherwise), `Content-Length`,
  `Accept-Ranges`, and `Range: bytes=N-` answered 206 with `Content-Range`.

`--throttle-bps` slows every body down; `--token` refuses requests without `Authorization: Bearer
TOKEN` (401). Every request is logged to `--log` as `METHOD PATH RANGE`."""

import argparse
import hashlib
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
CHUNK = 4096


def publish(
    root: Path, repo: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> dict:
    """Copy every file of `folder` into the hub as `repo` at `commit`; returns its metadata."""
    target = root / repo
    target.mkdir(parents=True, exist_ok=True)
    siblings = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        data = path.read_bytes()
        (target / path.name).write_bytes(data)
        entry = {
            "rfilename": path.name,
            "size": len(data),
            "blobId": hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest(),
        }
        if path.name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        siblings.append(entry)
    meta = {"id": repo, "sha": commit, "siblings": siblings}
    (root / f"{repo}.meta.json").write_text(json.dumps(meta))
    return meta


class Hub(BaseHTTPRequestHandler):
    root: Path
    log_file: Path
    throttle_bps: int = 0
    token: str = ""

    def log_message(self, *args) -> None:
        pass

    def _note(self) -> None:
        with self.log_file.open("a") as log:
            log.write(f"{self.command} {self.path} {self.headers.get('range', '-')}\n")

    def _meta(self, repo: str) -> dict | None:
        path = self.root / f"{repo}.meta.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {
            "Content-Type": "application/json",
            "Content-Length": str(len(data)),
            **(headers or {}),
        }.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.token and self.headers.get("authorization") != f"Bearer {self.token}":
            self._send_json(401, {"error": "Invalid credentials in Authorization header"})
            return False
        return True

    def do_GET(self) -> None:
        self._note()
        if not self._authorized():
            return
        parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
        if parts[:1] == ["api"] and parts[1:2] == ["models"]:
            self._model_info(parts[2:])
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        else:
            self._send_json(404, {"error": "not found"})

    do_HEAD = do_GET

    def _model_info(self, parts: list[str]) -> None:
        repo = "/".join(parts[:2])
        meta = self._meta(repo)
        revision = parts[3] if parts[2:3] == ["revision"] else "main"
        if meta is None or revision not in ("main", meta["sha"]):
            self._send_json(
                404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
            )
            return
        blobs = "blobs=true" in (urlparse(self.path).query or "").lower()
        siblings = (
            meta["siblings"] if blobs else [{"rfilename": s["rfilename"]} for s in meta["siblings"]]
        )
        self._send_json(
            200,
            {
                "id": repo,
                "modelId": repo,
                "sha": meta["sha"],
                "private": False,
                "siblings": siblings,
            },
        )

    def _resolve(self, repo: str, revision: str, name: str) -> None:
        meta = self._meta(repo)
        sibling = next(
            (s for s in (meta or {}).get("siblings", []) if s["rfilename"] == name), None
        )
        if meta is None or sibling is None or revision not in ("main", meta["sha"]):
            self._send_json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        data = (self.root / repo / name).read_bytes()
        headers = {
            "X-Repo-Commit": meta["sha"],
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if "lfs" in sibling:
            headers |= {
                "ETag": f'"{sibling["lfs"]["sha256"]}"',
                "X-Linked-Etag": f'"{sibling["lfs"]["sha256"]}"',
                "X-Linked-Size": str(sibling["size"]),
            }
        else:
            headers["ETag"] = f'"{sibling["blobId"]}"'
        start = 0
        asked = self.headers.get("range", "")
        if asked.startswith("bytes=") and self.command == "GET":
            start = int(asked[6:].split("-")[0] or 0)
            if start >= len(data):
                self._send_json(416, {"error": "range not satisfiable"})
                return
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(206 if start or "Content-Range" in headers else 200)
        for key, value in (headers | {"Content-Length": str(len(body))}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        for at in range(0, len(body), CHUNK):
            self.wfile.write(body[at : at + CHUNK])
            if self.throttle_bps:
                self.wfile.flush()
                time.sleep(CHUNK / self.throttle_bps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--throttle-bps", type=int, default=0)
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    Hub.root, Hub.log_file, Hub.throttle_bps, Hub.token = (
        args.root,
        args.log,
        args.throttle_bps,
        args.token,
    )
    ThreadingHTTPServer(("127.0.0.1", args.port), Hub).serve_forever()


if __name__ == "__main__":
    main()
