"""Embeddings and rerank scores as jobs, for any dialect's route or a batch line. `embed` takes
texts or token ids and returns one vector per input with the tokens they took; `score` takes
(query, document) pairs and returns one relevance score per pair. Each admits the request as
every job is admitted (`gateway.jobs.job.admit`: the model exists and is of the right kind, the
caller may use it and is within its limits), makes sure a node serves the model and queues one job
on the model's streams (waiting out a short Redis outage, as every request does: gateway/bus/outage.py),
then waits for its done event, which carries the result (`shared.wire.Pooled`). A batch line queues with `submit_embedding` and waits with `embedded`."""

import numpy as np

from gateway.dialects.gather import Embedded, Scored
from gateway.jobs.caller import Caller
from gateway.jobs.context import JobContext
from gateway.jobs.job import Job
from gateway.jobs.submit import admit, new_job_id, submit
from gateway.tracing import span
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest
from shared.wire import DoneEvent, PoolingRequest


async def embed(
    ctx: JobContext,
    caller: Caller,
    model: str,
    inputs: list[str | list[int]],
    *,
    dimensions: int | None = None,
    truncate: bool = False,
) -> Embedded:
    """One vector per input (a text, or the model's own token ids); `dimensions`: keep that many
    leading ones (models trained for it: `matryoshka_dimensions`); `truncate`: cut inputs longer
    than the model takes instead of refusing them (OpenAI refuses them: its route leaves it off;
    Ollama's `/api/embed` truncates by default)."""
    return await embedded(
        await submit_embedding(ctx, caller, model, inputs, dimensions=dimensions, truncate=truncate)
    )


async def score(
    ctx: JobContext, caller: Caller, model: str, queries: list[str], documents: list[str]
) -> Scored:
    """The relevance of each document to its query (a cross-encoder's score of the pair)."""

    async def admitted() -> Job:
        with span("admission"):
            profile = await admit(ctx, model, "rerank", caller, "interactive")
        request = PoolingRequest(
            job=new_job_id(), model=profile.id, kind="rerank", inputs=documents, queries=queries
        )
        return await _placed_and_submitted(ctx, caller, profile, request, "interactive")

    job = await ctx.outage.through(admitted)
    done = await _done(job)
    return Scored(list(done.pooled.scores), done.usage.prompt_tokens, job.id)


async def submit_embedding(
    ctx: JobContext,
    caller: Caller,
    model: str,
    inputs: list[str | list[int]],
    *,
    dimensions: int | None = None,
    truncate: bool = False,
    job_class: str = "interactive",
) -> Job:
    async def admitted() -> Job:
        with span("admission"):
            profile = await admit(ctx, model, "embedding", caller, job_class)
            check_dimensions(profile, dimensions)
        request = PoolingRequest(
            job=new_job_id(),
            model=profile.id,
            kind="embed",
            inputs=inputs,
            dimensions=dimensions,
            truncate=truncate,
        )
        return await _placed_and_submitted(ctx, caller, profile, request, job_class)

    return await ctx.outage.through(admitted)


async def embedded(job: Job) -> Embedded:
    done = await _done(job)
    return Embedded(
        [np.frombuffer(v, dtype="<f4") for v in done.pooled.vectors], done.usage.prompt_tokens
    )


def check_dimensions(profile: ModelProfile, dimensions: int | None) -> None:
    """A 400 unless the model was trained for `dimensions` (the node checks it is within the full size)."""
    allowed = profile.matryoshka_dimensions
    if dimensions is None or allowed == [] or (allowed and dimensions in allowed):
        return
    if allowed is None:
        message = f"{profile.id} was not trained for truncated embeddings (Matryoshka): it takes no dimensions"
    else:
        message = (
            f"{profile.id} takes dimensions of {', '.join(map(str, allowed))}; got {dimensions}"
        )
    raise InvalidRequest(message, param="dimensions")


async def _placed_and_submitted(
    ctx: JobContext,
    caller: Caller,
    profile: ModelProfile,
    request: PoolingRequest,
    job_class: str,
) -> Job:
    with span("placement"):
        await ctx.placer.ensure_placed(profile)
    return await submit(ctx, request, caller, job_class=job_class)


async def _done(job: Job) -> DoneEvent:
    """The job's done event (a pooling job sends no deltas; its error is raised), the job closed."""
    async with job:
        async for event in job.events():
            done = event
    return done
