"""Job events → `text_completion` objects, whole or streamed."""

from collections.abc import AsyncIterator

from gateway.gather import Gathered
from gateway.protocol.openai import Completion, CompletionChoice, CompletionChunk, CompletionLogprobs
from gateway.render import DEFAULT_FINISH_REASON, JobInfo, completion_usage
from shared.wire import DeltaEvent, DoneEvent, TokenLogprob


def legacy_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """Wire logprobs → the legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`
    shape; `offset` is where the first token starts in the choice's text."""
    if tokens is None:
        return None
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[t.logprob for t in tokens],
        tokens=[t.token for t in tokens],
        top_logprobs=[{top.token: top.logprob for top in t.top_logprobs} for t in tokens],
    )


def completion(job: JobInfo, gathered: Gathered) -> Completion:
    choices = [
        CompletionChoice(
            index=c.index,
            text=c.text,
            logprobs=legacy_logprobs(c.logprobs),
            finish_reason=c.finish_reason or DEFAULT_FINISH_REASON,
        )
        for c in gathered.choices
    ]
    return Completion(
        id=f"cmpl-{job.id}", created=job.created, model=job.model, choices=choices,
        usage=completion_usage(gathered.usage),
    )


async def completion_chunks(
    job: JobInfo, events: AsyncIterator[DeltaEvent | DoneEvent], *, n: int, include_usage: bool
) -> AsyncIterator[CompletionChunk]:
    """Text chunks (the last of each choice carries `finish_reason`), then the usage chunk."""

    def chunk(choices: list[CompletionChoice], **fields) -> CompletionChunk:
        return CompletionChunk(id=f"cmpl-{job.id}", created=job.created, model=job.model, choices=choices, **fields)

    offsets = dict.fromkeys(range(n), 0)  # per unfinished choice: characters of text sent so far
    async for event in events:
        if isinstance(event, DoneEvent):
            unfinished = [
                CompletionChoice(index=i, text="", finish_reason=DEFAULT_FINISH_REASON) for i in sorted(offsets)
            ]
            if unfinished:
                yield chunk(unfinished)
            if include_usage:
                yield chunk([], usage=completion_usage(event.usage))
            return
        for d in event.choices:
            if not (d.text or d.logprobs or d.finish_reason):
                continue
            logprobs = legacy_logprobs(d.logprobs, offsets.get(d.index, 0))
            choice = CompletionChoice(index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason)
            offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
            if d.finish_reason is not None:
                offsets.pop(d.index, None)
            yield chunk([choice])
