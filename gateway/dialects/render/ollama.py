"""Job events → Ollama's `/api/chat` and `/api/generate` objects (NDJSON lines when streamed).

A stream is one object per engine step that brought text (`done: false`), then a final object
(`done: true`) with `done_reason` (`stop`, or `length` when `num_predict` or the context cut it
off), the token counts and the durations in nanoseconds, from the node's timings: `load_duration`
is the time before an engine took the job (waiting in the queue, and for a load), then
`prompt_eval_duration` (prefill) and `eval_duration` (decode); `total_duration` is their sum. A
whole answer is its stream folded into one object, so both carry the same text and calls.

With `think`, the answer's `<think>…</think>` goes out as `thinking` (gateway/dialects/tools/thinking.py).
With tools, the rest runs through the model's tool-call parser (gateway/dialects/tools/parsers.py); a
call goes out whole, `arguments` as an object as Ollama's clients read it, once the next call
starts or the answer ends. The objects name the model as the client did (`name`).
"""

from collections.abc import AsyncIterator
from datetime import UTC, datetime

from gateway.dialects.protocol.ollama import (
    ChatResponse,
    GenerateResponse,
    Logprob,
    Message,
    Metrics,
    ToolCall,
    ToolCallFunction,
)
from gateway.dialects.render import JobInfo
from gateway.dialects.tools.parsers import (
    CallArgs,
    CallStart,
    Piece,
    Text,
    ToolCallParser,
    tool_input,
)
from gateway.dialects.tools.thinking import ThinkingSplitter
from shared.wire import ChoiceDelta, DeltaEvent, DoneEvent, TokenLogprob

NS_PER_MS = 1_000_000


def created_at(job: JobInfo) -> datetime:
    return datetime.fromtimestamp(job.created, UTC)


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def metrics(done: DoneEvent) -> Metrics:
    timings = done.timings
    return Metrics(
        total_duration=int((timings.queue_ms + timings.prefill_ms + timings.decode_ms) * NS_PER_MS),
        load_duration=int(timings.queue_ms * NS_PER_MS),
        prompt_eval_count=done.usage.prompt_tokens,
        prompt_eval_duration=int(timings.prefill_ms * NS_PER_MS),
        eval_count=done.usage.completion_tokens,
        eval_duration=int(timings.decode_ms * NS_PER_MS),
    )


def logprobs(tokens: list[TokenLogprob] | None) -> list[Logprob] | None:
    if not tokens:
        return None
    return [
        Logprob(
            token=t.token,
            logprob=t.logprob,
            bytes=t.bytes,
            top_logprobs=[
                Logprob(token=top.token, logprob=top.logprob, bytes=top.bytes)
                for top in t.top_logprobs
            ],
        )
        for t in tokens
    ]


class Calls:
    """Parser pieces → whole tool calls: a call is whole once the next one starts or the answer ends."""

    def __init__(self) -> None:
        self.open: CallStart | None = None
        self.arguments = ""

    def take(self, pieces: list[Piece], ended: bool) -> list[ToolCall]:
        made = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                made += self._close()
                self.open = piece
            elif isinstance(piece, CallArgs):
                self.arguments += piece.text
        return made + (self._close() if ended else [])

    def _close(self) -> list[ToolCall]:
        if self.open is None:
            return []
        call = self.open
        function = ToolCallFunction(
            index=call.index, name=call.name, arguments=tool_input(self.arguments)
        )
        self.open, self.arguments = None, ""
        return [ToolCall(id=f"call_{call.id}", function=function)]


async def _steps(
    events: AsyncIterator[DeltaEvent | DoneEvent],
) -> AsyncIterator[ChoiceDelta | DoneEvent]:
    """Each step's delta of the one choice Ollama asks for, then the done event."""
    async for event in events:
        if isinstance(event, DoneEvent):
            yield event
            return
        for delta in event.choices:
            yield delta


def _thought(splitter: ThinkingSplitter | None, text: str, ended: bool) -> tuple[str, str]:
    """A step's text → (thinking, content): all content unless the request asked to think."""
    if splitter is None:
        return "", text
    thinking, content = splitter.feed(text)
    if ended:
        held_thinking, held_content = splitter.finish()
        thinking, content = thinking + held_thinking, content + held_content
    return thinking, content


async def chat_chunks(
    job: JobInfo,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    name: str,
    parser: ToolCallParser | None,
    splitter: ThinkingSplitter | None = None,
) -> AsyncIterator[ChatResponse]:
    calls = Calls()
    finish_reason = None
    async for step in _steps(events):
        if isinstance(step, DoneEvent):
            yield ChatResponse(
                model=name,
                created_at=created_at(job),
                message=Message(role="assistant"),
                done=True,
                done_reason=done_reason(finish_reason),
                **metrics(step).model_dump(),
            )
            return
        finish_reason = step.finish_reason or finish_reason
        ended = step.finish_reason is not None
        thinking, content = _thought(splitter, step.text, ended)
        if parser is None:
            pieces: list[Piece] = [Text(content)]
        else:
            pieces = parser.feed(content) + (
                parser.finish(step.finish_reason == "length") if ended else []
            )
        text = "".join(piece.text for piece in pieces if isinstance(piece, Text))
        made = calls.take(pieces, ended)
        if text or thinking or made or step.logprobs:
            message = Message(
                role="assistant", content=text, thinking=thinking or None, tool_calls=made or None
            )
            yield ChatResponse(
                model=name,
                created_at=created_at(job),
                message=message,
                done=False,
                logprobs=logprobs(step.logprobs),
            )


async def generate_chunks(
    job: JobInfo,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    name: str,
    splitter: ThinkingSplitter | None = None,
) -> AsyncIterator[GenerateResponse]:
    finish_reason = None
    async for step in _steps(events):
        if isinstance(step, DoneEvent):
            yield GenerateResponse(
                model=name,
                created_at=created_at(job),
                response="",
                done=True,
                done_reason=done_reason(finish_reason),
                **metrics(step).model_dump(),
            )
            return
        finish_reason = step.finish_reason or finish_reason
        thinking, text = _thought(splitter, step.text, step.finish_reason is not None)
        if text or thinking or step.logprobs:
            yield GenerateResponse(
                model=name,
                created_at=created_at(job),
                response=text,
                thinking=thinking or None,
                done=False,
                logprobs=logprobs(step.logprobs),
            )


def chat_loaded(name: str, at: datetime) -> ChatResponse:
    """The answer to a request that only loads its model (no messages)."""
    return ChatResponse(
        model=name, created_at=at, message=Message(role="assistant"), done=True, done_reason="load"
    )


def generate_loaded(name: str, at: datetime) -> GenerateResponse:
    """The answer to a request that only loads its model (an empty prompt)."""
    return GenerateResponse(model=name, created_at=at, response="", done=True, done_reason="load")


async def whole_chat(chunks: AsyncIterator[ChatResponse]) -> ChatResponse:
    """A chat stream folded into one object, as `stream: false` answers."""
    content, thinking, calls, probs = [], [], [], []
    async for chunk in chunks:
        content.append(chunk.message.content or "")
        thinking.append(chunk.message.thinking or "")
        calls += chunk.message.tool_calls or []
        probs += chunk.logprobs or []
        if chunk.done:
            message = Message(
                role="assistant",
                content="".join(content),
                thinking="".join(thinking) or None,
                tool_calls=calls or None,
            )
            return chunk.model_copy(update={"message": message, "logprobs": probs or None})
    raise RuntimeError("the job's events ended without a done event")


async def whole_generate(chunks: AsyncIterator[GenerateResponse]) -> GenerateResponse:
    """A generate stream folded into one object, as `stream: false` answers."""
    response, thinking, probs = [], [], []
    async for chunk in chunks:
        response.append(chunk.response)
        thinking.append(chunk.thinking or "")
        probs += chunk.logprobs or []
        if chunk.done:
            return chunk.model_copy(
                update={
                    "response": "".join(response),
                    "thinking": "".join(thinking) or None,
                    "logprobs": probs or None,
                }
            )
    raise RuntimeError("the job's events ended without a done event")
