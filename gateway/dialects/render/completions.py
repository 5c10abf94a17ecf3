"""Job events → `text_completion` objects, whole or streamed. With `echo`, each choice's text
starts with the prompt (a choice's first streamed chunk carries it), and its logprobs with the
prompt's tokens (the first has none)."""

from collections.abc import AsyncIterator

from gateway.dialects.gather import Gathered
from gateway.dialects.protocol.openai import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
)
from gateway.dialects.render import DEFAULT_FINISH_REASON, JobInfo, completion_usage
from shared.wire import DeltaEvent, DoneEvent, PromptLogprob, TokenLogprob

Logprobs = list[PromptLogprob] | list[TokenLogprob]


def legacy_logprobs(tokens: Logprobs | None, offset: int = 0) -> CompletionLogprobs | None:
    """Wire logprobs → the legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`
    shape; `offset` is where the first token starts in the choice's text. The prompt's first
    token (under `echo`) has neither a logprob nor alternatives: None."""
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
        top_logprobs=[
            None if t.logprob is None else {top.token: top.logprob for top in t.top_logprobs}
            for t in tokens
        ],
    )


def _echoed(
    prompt: str | None,
    prompt_logprobs: list[PromptLogprob] | None,
    text: str,
    logprobs: list[TokenLogprob] | None,
) -> tuple[str, Logprobs | None]:
    """A choice's (first) text and logprobs with the prompt's in front, when echoing."""
    if prompt is None:
        return text, logprobs
    if logprobs is not None and prompt_logprobs is not None:
        return prompt + text, [*prompt_logprobs, *logprobs]
    return prompt + text, logprobs


def completion(job: JobInfo, gathered: Gathered, echo: bool = False) -> Completion:
    prompt = job.prompt_text if echo else None
    choices = []
    for c in gathered.choices:
        text, logprobs = _echoed(prompt, c.prompt_logprobs, c.text, c.logprobs)
        choices.append(
            CompletionChoice(
                index=c.index,
                text=text,
                logprobs=legacy_logprobs(logprobs),
                finish_reason=c.finish_reason or DEFAULT_FINISH_REASON,
            )
        )
    return Completion(
        id=f"cmpl-{job.id}",
        created=job.created,
        model=job.model,
        choices=choices,
        usage=completion_usage(gathered.usage),
    )


async def completion_chunks(
    job: JobInfo,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    *,
    n: int,
    include_usage: bool,
    echo: bool = False,
) -> AsyncIterator[CompletionChunk]:
    """Text chunks (the last of each choice carries `finish_reason`), then the usage chunk."""

    def chunk(choices: list[CompletionChoice], **fields) -> CompletionChunk:
        return CompletionChunk(
            id=f"cmpl-{job.id}", created=job.created, model=job.model, choices=choices, **fields
        )

    offsets = dict.fromkeys(range(n), 0)  # per unfinished choice: characters of text sent so far
    unechoed = set(range(n)) if echo else set()
    async for event in events:
        if isinstance(event, DoneEvent):
            unfinished = [
                CompletionChoice(index=i, text="", finish_reason=DEFAULT_FINISH_REASON)
                for i in sorted(offsets)
            ]
            if unfinished:
                yield chunk(unfinished)
            if include_usage:
                yield chunk([], usage=completion_usage(event.usage))
            return
        for d in event.choices:
            text, logprobs = _echoed(
                job.prompt_text if d.index in unechoed else None,
                d.prompt_logprobs,
                d.text,
                d.logprobs,
            )
            unechoed.discard(d.index)
            if not (text or logprobs or d.finish_reason):
                continue
            choice = CompletionChoice(
                index=d.index,
                text=text,
                logprobs=legacy_logprobs(logprobs, offsets.get(d.index, 0)),
                finish_reason=d.finish_reason,
            )
            offsets[d.index] = offsets.get(d.index, 0) + len(text)
            if d.finish_reason is not None:
                offsets.pop(d.index, None)
            yield chunk([choice])
