"""Ollama's API on the gateway's own port: point an Ollama client at `http://HOST:31313`.

`POST /api/chat` and `/api/generate` become jobs as `/v1/chat/completions` requests do
(gateway/dialects/protocol/ollama.py translates them) and answer in NDJSON lines, or one object with
`stream: false` (gateway/dialects/render/ollama.py); with no messages (an empty prompt) they place the model
on a node and answer `done_reason: "load"`. `GET /api/tags`, `POST /api/show` and `GET /api/ps` read
the catalogue and the fleet (gateway/dialects/render/ollama_models.py); `GET /api/version` needs no key, as
VS Code's Copilot Chat asks it before anything else. `POST /api/pull` (the admin key, or anyone while
auth is off: an API key gets 403) of a catalogue model with an
`hf:` source asks the nodes that may run it to fetch its files and follows them (a progress line
per node as its bytes move, then `success`, or an error line); for other catalogue models it
succeeds at once, and it says pulling is not available for models outside the catalogue; `DELETE
/api/delete` (admin key) unloads the model from every node (the catalogue itself is models.toml's).
`POST /api/embed` (and the older `/api/embeddings`) embed through the same jobs as `/v1/embeddings`
(gateway/jobs/pooling.py).
"""

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.datastructures import MutableHeaders

from gateway.dialects.errors import ollama_error_body
from gateway.dialects.protocol.ollama import (
    API_VERSION,
    ChatRequest,
    DeleteRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbedRequest,
    GenerateRequest,
    ProgressResponse,
    PullRequest,
    ShowRequest,
    VersionResponse,
)
from gateway.dialects.render.embeddings import embed_response
from gateway.dialects.render.ollama import (
    chat_chunks,
    chat_loaded,
    generate_chunks,
    generate_loaded,
    whole_chat,
    whole_generate,
)
from gateway.dialects.render.ollama_models import model_list, running, show
from gateway.fleet import operations, pulls
from gateway.http.auth import Caller, CallerDep, require_admin
from gateway.http.context import Ctx, GatewayContext
from gateway.http.vector_json import VectorJSONResponse
from gateway.jobs import ndjson, pooling
from gateway.jobs.disconnect import unless_disconnected
from gateway.jobs.job import Job
from gateway.jobs.streaming import stream_job
from gateway.jobs.submit import admit, submit_request
from shared.catalog import ModelProfile
from shared.errors import CortexError, Forbidden, ModelNotFound, ModelPullFailed
from shared.model_store import HUB_PREFIX

log = logging.getLogger(__name__)


class JsonBody(APIRoute):
    """Ollama's clients and its documented `curl -d '{…}'` send JSON under any content type
    (curl's is a form's): the body is read as JSON whatever the header says."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            MutableHeaders(scope=request.scope)["content-type"] = "application/json"
            return await handler(request)

        return as_json


router = APIRouter(route_class=JsonBody)  # an API key's
public = APIRouter()
admin = APIRouter(route_class=JsonBody, dependencies=[Depends(require_admin)])


@router.post("/api/chat", response_model=None)
async def chat(body: ChatRequest, ctx: Ctx, request: Request, caller: CallerDep) -> Response:
    if not body.messages:
        return await _load(ctx, caller, chat_loaded(body.model, datetime.now(UTC)))
    job = await submit_request(ctx, body, caller)
    chunks = chat_chunks(
        job,
        job.events() if body.stream else job.final_events(),
        body.model,
        job.parsers(),
        body.splitter(),
    )
    return await _answer(request, job, chunks, body.stream, whole_chat)


@router.post("/api/generate", response_model=None)
async def generate(
    body: GenerateRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> Response:
    if not body.prompt:
        return await _load(ctx, caller, generate_loaded(body.model, datetime.now(UTC)))
    job = await submit_request(ctx, body, caller)
    chunks = generate_chunks(
        job, job.events() if body.stream else job.final_events(), body.model, body.splitter()
    )
    return await _answer(request, job, chunks, body.stream, whole_generate)


async def _answer(
    request: Request,
    job: Job,
    chunks: AsyncIterator[BaseModel],
    stream: bool,
    whole: Callable[[AsyncIterator[BaseModel]], Awaitable[BaseModel]],
) -> Response:
    if stream:
        return await stream_job(
            request,
            job,
            chunks,
            frames=ndjson.frames,
            media_type=ndjson.MEDIA_TYPE,
            queue_notice=None,
        )
    async with job:
        answer = await unless_disconnected(request, whole(chunks))
    return JSONResponse(answer.model_dump(mode="json", exclude_none=True))


async def _load(ctx: GatewayContext, caller: Caller, answer: BaseModel) -> JSONResponse:
    """Place the model on a node if none serves it (it is loading there when this answers), as
    Ollama loads for a request with nothing to generate; admitted as every request is (the key may
    use the model and is within its limits: gateway/jobs/submit.py `admit`)."""
    profile = await ctx.outage.through(
        lambda: admit(ctx, answer.model, None, caller, "interactive")
    )
    await ctx.placer.ensure_placed(profile)
    return JSONResponse(answer.model_dump(mode="json", exclude_none=True))


def _usable(ctx: GatewayContext, caller: Caller) -> list[ModelProfile]:
    return [p for p in ctx.catalog.profiles.values() if caller.may_use({p.id, *p.aliases})]


def _profile(ctx: GatewayContext, caller: Caller, name: str) -> ModelProfile:
    profile = ctx.catalog.resolve(name)
    caller.check_may_use(profile)
    return profile


@router.post("/api/embed")
async def embed(
    body: EmbedRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> VectorJSONResponse:
    started = time.perf_counter_ns()
    done = await unless_disconnected(
        request,
        pooling.embed(
            ctx, caller, body.model, body.inputs, dimensions=body.dimensions, truncate=body.truncate
        ),
    )
    return VectorJSONResponse(
        embed_response(
            body.model,
            done.vectors,
            total_duration=time.perf_counter_ns() - started,
            prompt_eval_count=done.prompt_tokens,
        )
    )


@router.post("/api/embeddings")
async def embeddings(
    body: EmbeddingRequest, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    done = await unless_disconnected(
        request, pooling.embed(ctx, caller, body.model, [body.prompt], truncate=True)
    )
    return JSONResponse(
        EmbeddingResponse(embedding=done.vectors[0].tolist()).model_dump(mode="json")
    )


@router.get("/api/tags")
async def tags(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse(
        model_list(_usable(ctx, caller), await ctx.fleet.serving_nodes(fresh=True)).model_dump(
            mode="json"
        )
    )


@router.post("/api/show")
async def show_model(body: ShowRequest, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    profile = _profile(ctx, caller, body.model)
    return JSONResponse(
        show(profile, await ctx.fleet.serving_nodes(fresh=True)).model_dump(mode="json")
    )


@router.get("/api/ps")
async def ps(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    loaded = running(
        _usable(ctx, caller), await ctx.fleet.live_nodes(fresh=True), await ctx.placer.pinned()
    )
    return JSONResponse(loaded.model_dump(mode="json"))


@router.post("/api/pull", response_model=None)
async def pull(body: PullRequest, ctx: Ctx, caller: CallerDep) -> Response:
    """Pulling puts files on the fleet's disks and may evict others': the admin key's (or anyone's
    while auth is off), as `POST /admin/models/{model}/pull` is; an API key gets 403."""
    if caller.key is not None:
        raise Forbidden(
            f"API key {caller.name!r} may not pull models onto the fleet: pulling takes the admin "
            "key (an operator runs `cortex models pull MODEL`)"
        )
    try:
        profile = _profile(ctx, caller, body.model)
    except ModelNotFound:
        raise ModelNotFound(
            f"pulling models is not available yet: '{body.model}' is not in this fleet's catalogue "
            "(an operator adds it to models.toml)",
            param="model",
        ) from None
    progress = (
        _pull_progress(ctx, profile, await operations.pull(ctx.placer, profile.id))
        if profile.source.startswith(HUB_PREFIX)
        else _pulled()
    )
    if body.stream:
        return StreamingResponse(_lines(progress), media_type=ndjson.MEDIA_TYPE)
    async for last in progress:
        pass
    return JSONResponse(last.model_dump(exclude_none=True))


async def _pulled() -> AsyncIterator[ProgressResponse]:
    yield ProgressResponse(status="success")


async def _pull_progress(
    ctx: GatewayContext, profile: ModelProfile, nodes: list[str]
) -> AsyncIterator[ProgressResponse]:
    """A line per node whenever its bytes move, then `success` once every node has the files; a node
    that cannot get them raises ModelPullFailed, naming it and why."""
    folder = operations.hub_folder(profile)
    sent: dict[str, int] = {}
    async for states in pulls.watch(ctx.fleet, folder, nodes):
        for node, state in states.items():
            if state.why:
                log.warning("%s could not pull %s: %s", node, profile.id, state.why)
                raise ModelPullFailed(f"{node} could not pull {profile.id}: {state.why}")
            if (
                state.progress is not None
                and state.progress.bytes_total
                and sent.get(node) != state.progress.bytes_done
            ):
                sent[node] = state.progress.bytes_done
                yield ProgressResponse(
                    status=f"pulling {folder} on {node}",
                    digest=f"{node}/{folder}",
                    total=state.progress.bytes_total,
                    completed=state.progress.bytes_done,
                )
    yield ProgressResponse(status="success")


async def _lines(progress: AsyncIterator[ProgressResponse]) -> AsyncIterator[bytes]:
    try:
        async for item in progress:
            yield ndjson.line(item)
    except CortexError as exc:
        yield ndjson.line(ollama_error_body(exc))


@public.get("/api/version")
async def version() -> JSONResponse:
    return JSONResponse(VersionResponse(version=API_VERSION).model_dump())


@admin.delete("/api/delete")
async def delete(body: DeleteRequest, ctx: Ctx) -> Response:
    await operations.unload(ctx.placer, body.model)
    return Response()
