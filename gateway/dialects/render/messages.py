"""Job events → Anthropic `message` objects and Messages stream events.

Both paths run the text through the same tool-call parser (when the request has tools) and
group its pieces into content blocks the same way, so a streamed answer and a whole one carry
the same blocks: text, then `tool_use` blocks whose `input` streams as `input_json_delta`.
"""

from collections.abc import AsyncIterator, Iterator

from gateway.dialects.gather import GatheredChoice
from gateway.dialects.protocol.anthropic import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    Usage,
)
from gateway.dialects.render import JobInfo
from gateway.dialects.tools import parsers
from gateway.dialects.tools.parsers import tool_input
from shared.wire import DeltaEvent, DoneEvent
from shared.wire import Usage as WireUsage


def message_id(job: JobInfo) -> str:
    return f"msg_{job.id}"


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool) -> StopReason:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


class Blocks:
    """Parser pieces → content block events, opening and closing blocks as the pieces change kind."""

    def __init__(self, parser: parsers.ToolCallParser | None):
        self.parser = parser
        self.index = -1
        self.open: str | int | None = None  # "text", or the index of the open call
        self.called = False

    def feed(self, text: str) -> Iterator[StreamEvent]:
        pieces = self.parser.feed(text) if self.parser else ([parsers.Text(text)] if text else [])
        yield from self._events(pieces)

    def finish(self, cut_off: bool) -> Iterator[StreamEvent]:
        yield from self._events(self.parser.finish(cut_off) if self.parser else [])
        if self.index < 0:  # an empty answer is one empty text block
            yield from self._start(TextBlock(text=""), "text")
        yield from self._close()

    def _events(self, pieces: list[parsers.Piece]) -> Iterator[StreamEvent]:
        for piece in pieces:
            if isinstance(piece, parsers.Text):
                if self.open != "text":
                    yield from self._start(TextBlock(text=""), "text")
                yield ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=piece.text))
            elif isinstance(piece, parsers.CallStart):
                self.called = True
                yield from self._start(
                    ToolUseBlock(id=f"toolu_{piece.id}", name=piece.name, input={}), piece.index
                )
            elif piece.text:
                yield ContentBlockDeltaEvent(
                    index=self.index, delta=InputJSONDelta(partial_json=piece.text)
                )

    def _start(self, block: ContentBlock, kind: str | int) -> Iterator[StreamEvent]:
        yield from self._close()
        self.index += 1
        self.open = kind
        yield ContentBlockStartEvent(index=self.index, content_block=block)

    def _close(self) -> Iterator[StreamEvent]:
        if self.open is not None:
            self.open = None
            yield ContentBlockStopEvent(index=self.index)


def content_blocks(events: list[StreamEvent]) -> list[ContentBlock]:
    """Block events folded into whole blocks, as a client folds the stream."""
    blocks: list[ContentBlock] = []
    args: dict[int, str] = {}
    for event in events:
        if isinstance(event, ContentBlockStartEvent):
            blocks.append(event.content_block.model_copy())
        elif isinstance(event, ContentBlockDeltaEvent) and isinstance(event.delta, TextDelta):
            blocks[event.index].text += event.delta.text
        elif isinstance(event, ContentBlockDeltaEvent):
            args[event.index] = args.get(event.index, "") + event.delta.partial_json
    for index, text in args.items():
        blocks[index].input = tool_input(text)
    return blocks


def message(
    job: JobInfo, choice: GatheredChoice, usage: WireUsage, parser: parsers.ToolCallParser | None
) -> Message:
    blocks = Blocks(parser)
    events = [*blocks.feed(choice.text), *blocks.finish(choice.finish_reason == "length")]
    return Message(
        id=message_id(job),
        model=job.model,
        content=content_blocks(events),
        stop_reason=stop_reason(choice.finish_reason, choice.stop_sequence, blocks.called),
        stop_sequence=choice.stop_sequence,
        usage=Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens),
    )


async def message_events(
    job: JobInfo,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    parser: parsers.ToolCallParser | None,
) -> AsyncIterator[StreamEvent]:
    """message_start, the content block events, message_delta (stop reason, usage), message_stop.
    message_start waits for the job's first event: by then the node has said the prompt's length."""
    blocks = Blocks(parser)
    finish_reason = stop_sequence = None
    started = False
    async for event in events:
        if not started:
            started = True
            yield MessageStartEvent(
                message=Message(
                    id=message_id(job),
                    model=job.model,
                    content=[],
                    stop_reason=None,
                    usage=Usage(input_tokens=job.prompt_tokens, output_tokens=0),
                )
            )
        if isinstance(event, DoneEvent):
            for block_event in blocks.finish(finish_reason == "length"):
                yield block_event
            yield MessageDeltaEvent(
                delta=MessageDelta(
                    stop_reason=stop_reason(finish_reason, stop_sequence, blocks.called),
                    stop_sequence=stop_sequence,
                ),
                usage=MessageDeltaUsage(
                    input_tokens=event.usage.prompt_tokens,
                    output_tokens=event.usage.completion_tokens,
                ),
            )
            yield MessageStopEvent()
            return
        for delta in event.choices:
            for block_event in blocks.feed(delta.text):
                yield block_event
            finish_reason = delta.finish_reason or finish_reason
            stop_sequence = delta.stop_sequence or stop_sequence
