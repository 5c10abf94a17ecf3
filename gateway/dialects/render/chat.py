"""Job events → `chat.completion` and `chat.completion.chunk` objects. With tools, each
choice's text runs through the model's tool-call parser: calls become `tool_calls` (streamed as
a first delta with id and name, then `function.arguments` pieces) and `finish_reason` becomes
`tool_calls`."""

from collections.abc import AsyncIterator

from gateway.dialects.gather import Gathered
from gateway.dialects.protocol.openai import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionStreamResponseDelta,
    ChatCompletionTokenLogprob,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
    FunctionCall,
)
from gateway.dialects.render import DEFAULT_FINISH_REASON, JobInfo, completion_usage
from gateway.dialects.tools.parsers import (
    CallStart,
    Parsers,
    Piece,
    Text,
    ToolCallParser,
    collect,
    no_parser,
)
from shared.wire import DeltaEvent, DoneEvent, TokenLogprob

Delta = ChatCompletionStreamResponseDelta


def finish_reason(reason: str | None, called: bool) -> str:
    return "tool_calls" if called and reason in (None, "stop") else reason or DEFAULT_FINISH_REASON


def _message(
    text: str, parser: ToolCallParser | None, cut_off: bool
) -> tuple[ChatCompletionMessage, bool]:
    if parser is None:
        return ChatCompletionMessage(content=text), False
    parsed = collect(parser.feed(text) + parser.finish(cut_off))
    calls = [
        ChatCompletionMessageToolCall(
            id=f"call_{c.id}", function=FunctionCall(name=c.name, arguments=c.arguments)
        )
        for c in parsed.calls
    ]
    return ChatCompletionMessage(content=parsed.content or None, tool_calls=calls or None), bool(
        calls
    )


def chat_logprobs(tokens: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    """Wire logprobs → `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    if tokens is None:
        return None
    return ChoiceLogprobs(
        content=[ChatCompletionTokenLogprob.model_validate(t, from_attributes=True) for t in tokens]
    )


def chat_completion(
    job: JobInfo, gathered: Gathered, parsers: Parsers = no_parser
) -> ChatCompletion:
    choices = []
    for c in gathered.choices:
        message, called = _message(c.text, parsers(), c.finish_reason == "length")
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(c.logprobs),
                finish_reason=finish_reason(c.finish_reason, called),
            )
        )
    return ChatCompletion(
        id=f"chatcmpl-{job.id}",
        created=job.created,
        model=job.model,
        choices=choices,
        usage=completion_usage(gathered.usage),
    )


def _piece_delta(piece: Piece) -> Delta:
    if isinstance(piece, Text):
        return Delta(content=piece.text)
    if isinstance(piece, CallStart):
        function = ChoiceDeltaToolCallFunction(name=piece.name, arguments="")
        return Delta(
            tool_calls=[
                ChoiceDeltaToolCall(
                    index=piece.index, id=f"call_{piece.id}", type="function", function=function
                )
            ]
        )
    return Delta(
        tool_calls=[
            ChoiceDeltaToolCall(
                index=piece.index, function=ChoiceDeltaToolCallFunction(arguments=piece.text)
            )
        ]
    )


async def chat_chunks(
    job: JobInfo,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    *,
    n: int,
    include_usage: bool,
    parsers: Parsers = no_parser,
) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk per choice, content chunks, a finish chunk per choice, then the usage chunk."""

    def chunk(index: int, delta: Delta, **fields) -> ChatCompletionChunk:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, **fields)
        return ChatCompletionChunk(
            id=f"chatcmpl-{job.id}", created=job.created, model=job.model, choices=[choice]
        )

    for index in range(n):
        yield chunk(index, Delta(role="assistant", content=""))
    unfinished = set(range(n))
    choice_parsers: dict[int, ToolCallParser | None] = {}
    called: set[int] = set()
    async for event in events:
        if isinstance(event, DoneEvent):
            for index in sorted(unfinished):
                yield chunk(index, Delta(), finish_reason=DEFAULT_FINISH_REASON)
            if include_usage:
                yield ChatCompletionChunk(
                    id=f"chatcmpl-{job.id}",
                    created=job.created,
                    model=job.model,
                    choices=[],
                    usage=completion_usage(event.usage),
                )
            return
        for d in event.choices:
            parser = (
                choice_parsers[d.index]
                if d.index in choice_parsers
                else choice_parsers.setdefault(d.index, parsers())
            )
            if parser is None:
                if d.text or d.logprobs:
                    yield chunk(d.index, Delta(content=d.text), logprobs=chat_logprobs(d.logprobs))
            else:
                ended = d.finish_reason is not None
                pieces = parser.feed(d.text) + (
                    parser.finish(d.finish_reason == "length") if ended else []
                )
                for i, piece in enumerate(pieces):
                    called.update([d.index] if isinstance(piece, CallStart) else [])
                    yield chunk(
                        d.index,
                        _piece_delta(piece),
                        logprobs=chat_logprobs(d.logprobs) if i == 0 else None,
                    )
            if d.finish_reason is not None:
                unfinished.discard(d.index)
                yield chunk(
                    d.index,
                    Delta(),
                    finish_reason=finish_reason(d.finish_reason, d.index in called),
                )
