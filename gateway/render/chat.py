"""Job events → `chat.completion` and `chat.completion.chunk` objects."""

from collections.abc import AsyncIterator

from gateway.gather import Gathered
from gateway.protocol.openai import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionStreamResponseDelta,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
)
from gateway.render import DEFAULT_FINISH_REASON, JobInfo, completion_usage
from shared.wire import DeltaEvent, DoneEvent, TokenLogprob

Delta = ChatCompletionStreamResponseDelta


def chat_logprobs(tokens: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    """Wire logprobs → `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    if tokens is None:
        return None
    return ChoiceLogprobs(content=[ChatCompletionTokenLogprob.model_validate(t.model_dump()) for t in tokens])


def chat_completion(job: JobInfo, gathered: Gathered) -> ChatCompletion:
    choices = [
        ChatCompletionChoice(
            index=c.index,
            message=ChatCompletionMessage(content=c.text),
            logprobs=chat_logprobs(c.logprobs),
            finish_reason=c.finish_reason or DEFAULT_FINISH_REASON,
        )
        for c in gathered.choices
    ]
    return ChatCompletion(
        id=f"chatcmpl-{job.id}", created=job.created, model=job.model, choices=choices,
        usage=completion_usage(gathered.usage),
    )


async def chat_chunks(
    job: JobInfo, events: AsyncIterator[DeltaEvent | DoneEvent], *, n: int, include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk per choice, content chunks, a finish chunk per choice, then the usage chunk."""

    def chunk(index: int, delta: Delta, **fields) -> ChatCompletionChunk:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, **fields)
        return ChatCompletionChunk(id=f"chatcmpl-{job.id}", created=job.created, model=job.model, choices=[choice])

    for index in range(n):
        yield chunk(index, Delta(role="assistant", content=""))
    unfinished = set(range(n))
    async for event in events:
        if isinstance(event, DoneEvent):
            for index in sorted(unfinished):
                yield chunk(index, Delta(), finish_reason=DEFAULT_FINISH_REASON)
            if include_usage:
                yield ChatCompletionChunk(
                    id=f"chatcmpl-{job.id}", created=job.created, model=job.model, choices=[],
                    usage=completion_usage(event.usage),
                )
            return
        for d in event.choices:
            if d.text or d.logprobs:
                yield chunk(d.index, Delta(content=d.text), logprobs=chat_logprobs(d.logprobs))
            if d.finish_reason is not None:
                unfinished.discard(d.index)
                yield chunk(d.index, Delta(), finish_reason=d.finish_reason)
