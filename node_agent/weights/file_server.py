"""The node's file server: the model files it holds, read-only, to other nodes of the fleet.

`GET /files/{folder}/{file}` (ranges supported, for resumed fetches) with `Authorization: Bearer
<fleet_secret>`; 401 without the secret, 403 for a path that leaves its model folder, 404 for
anything else that is not a file of a complete model folder (a pull in progress is not served, nor
the bookkeeping under its `.cache/`)."""

import asyncio
import hmac
import logging

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from shared.model_store import WORK_DIR, ModelStore

log = logging.getLogger(__name__)


def app(store: ModelStore, secret: str) -> Starlette:
    expected = f"Bearer {secret}".encode()

    async def serve_file(request: Request) -> Response:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return JSONResponse(
                {"error": "this node's files need the fleet secret (Authorization: Bearer)"},
                status_code=401,
            )
        asked = request.path_params["path"]
        folder, _, name = asked.partition("/")
        root = store.root.resolve()
        base = (root / folder).resolve()
        path = (base / name).resolve()
        if base.parent != root or not path.is_relative_to(base):
            return JSONResponse(
                {"error": f"{asked!r} is outside the models directory"}, status_code=403
            )
        if not (
            name
            and path.is_file()
            and WORK_DIR not in path.relative_to(base).parts
            and store.manifest(folder) is not None
        ):
            return JSONResponse({"error": f"no model file {asked!r} here"}, status_code=404)
        return FileResponse(path)

    return Starlette(routes=[Route("/files/{path:path}", serve_file, methods=["GET", "HEAD"])])


class FileServer:
    def __init__(self, store: ModelStore, secret: str, host: str, port: int):
        self.store = store
        # uvicorn takes SIGTERM/SIGINT while it serves, stops, and raises them again for the agent
        self._server = uvicorn.Server(
            uvicorn.Config(
                app(store, secret),
                host=host,
                port=port,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
        )
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="file-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the port is taken: say so
            await asyncio.sleep(0.02)
        log.info(
            "serving the model files in %s to peers on port %d",
            self.store.root,
            self._server.config.port,
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
