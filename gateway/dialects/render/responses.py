"""Job events → Responses API objects and stream events.

The text runs through the tool-call parser (when the request has tools) and its pieces become
output items: a `message` with one `output_text` part, and a `function_call` per call. A whole
response folds the same events a stream sends, so both carry the same output. What a response
says besides its output comes from its request, kept as a `ResponseSpec`, so that a gateway that
never saw the request renders it from the job's event log (resumed streams, background responses).
"""

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

from gateway.dialects.gather import GatheredChoice
from gateway.dialects.protocol.responses import (
    IncompleteDetails,
    InputTokensDetails,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseCreateParams,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItem,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from gateway.dialects.protocol.responses_tools import offered_name
from gateway.dialects.render import JobInfo
from gateway.dialects.tools import parsers
from shared.errors import JobCancelled
from shared.wire import DeltaEvent, DoneEvent, ErrorEvent, Event, StartEvent, Usage


def response_id(job: JobInfo) -> str:
    return f"resp_{job.id}"


@dataclass
class ResponseSpec:
    """A response's request, as far as rendering it needs: the fields the response echoes, and the
    (namespace, name) each offered function is reported under, by the name the model knows it by."""

    fields: dict[str, Any]
    functions: dict[str, tuple[str | None, str]]

    @classmethod
    def of(cls, body: ResponseCreateParams) -> "ResponseSpec":
        fields = dict(
            instructions=body.instructions,
            metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=body.temperature,
            tool_choice=body.tool_choice or "auto",
            tools=[
                t.model_dump(mode="json", exclude_none=True, by_alias=True)
                for t in body.tools or []
            ],
            top_p=body.top_p,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            store=body.store is not False,
            truncation=body.truncation or "disabled",
            background=bool(body.background),
            text=(
                body.text.model_dump(mode="json", exclude_none=True, by_alias=True)
                if body.text
                else {"format": {"type": "text"}}
            ),
        )
        if not isinstance(fields["tool_choice"], str):
            fields["tool_choice"] = body.tool_choice.model_dump(mode="json")
        return cls(fields, {name: body.offer.called(name) for name in body.offer.functions})

    def dump(self) -> dict[str, Any]:
        return {"fields": self.fields, "functions": self.functions}

    @classmethod
    def load(cls, data: dict[str, Any]) -> "ResponseSpec":
        return cls(
            data["fields"], {name: tuple(called) for name, called in data["functions"].items()}
        )

    def called(self, name: str) -> tuple[str | None, str]:
        """The (namespace, name) a call of `name` is reported under."""
        return self.functions.get(name, (None, name))


class Output:
    """Parser pieces → output items and their events, opening and closing items as pieces change kind."""

    def __init__(self, job: JobInfo, parser: parsers.ToolCallParser | None, spec: ResponseSpec):
        self.job, self.parser, self.spec = job, parser, spec
        self.items: list[ResponseOutputItem] = []
        self.open = False

    def feed(self, text: str) -> Iterator[ResponseStreamEvent]:
        pieces = self.parser.feed(text) if self.parser else ([parsers.Text(text)] if text else [])
        yield from self._events(pieces)

    def finish(self, cut_off: bool) -> Iterator[ResponseStreamEvent]:
        yield from self._events(self.parser.finish(cut_off) if self.parser else [])
        yield from self._close("incomplete" if cut_off else "completed")

    def _events(self, pieces: list[parsers.Piece]) -> Iterator[ResponseStreamEvent]:
        for piece in pieces:
            if isinstance(piece, parsers.Text):
                if not (self.open and isinstance(self.items[-1], ResponseOutputMessage)):
                    yield from self._add(
                        ResponseOutputMessage(
                            id=f"msg_{self.job.id}_{len(self.items)}",
                            content=[],
                            status="in_progress",
                        )
                    )
                    self.items[-1].content.append(ResponseOutputText(text=""))
                    yield ResponseContentPartAddedEvent(
                        item_id=self.items[-1].id,
                        output_index=len(self.items) - 1,
                        part=ResponseOutputText(text=""),
                    )
                self.items[-1].content[0].text += piece.text
                yield ResponseTextDeltaEvent(
                    item_id=self.items[-1].id, output_index=len(self.items) - 1, delta=piece.text
                )
            elif isinstance(piece, parsers.CallStart):
                namespace, name = self.spec.called(piece.name)
                yield from self._add(
                    ResponseFunctionToolCall(
                        id=f"fc_{piece.id}",
                        call_id=f"call_{piece.id}",
                        name=name,
                        namespace=namespace,
                        arguments="",
                        status="in_progress",
                    )
                )
            elif piece.text:
                self.items[-1].arguments += piece.text
                yield ResponseFunctionCallArgumentsDeltaEvent(
                    item_id=self.items[-1].id, output_index=len(self.items) - 1, delta=piece.text
                )

    def _add(self, item: ResponseOutputItem) -> Iterator[ResponseStreamEvent]:
        yield from self._close("completed")
        self.items.append(item)
        self.open = True
        yield ResponseOutputItemAddedEvent(
            output_index=len(self.items) - 1, item=item.model_copy(deep=True)
        )

    def _close(self, status: str) -> Iterator[ResponseStreamEvent]:
        if not self.open:
            return
        self.open = False
        item, at = self.items[-1], len(self.items) - 1
        item.status = status
        if isinstance(item, ResponseOutputMessage):
            part = item.content[0]
            yield ResponseTextDoneEvent(item_id=item.id, output_index=at, text=part.text)
            yield ResponseContentPartDoneEvent(
                item_id=item.id, output_index=at, part=part.model_copy()
            )
        else:
            yield ResponseFunctionCallArgumentsDoneEvent(
                item_id=item.id, output_index=at, name=item.name, arguments=item.arguments
            )
        yield ResponseOutputItemDoneEvent(output_index=at, item=item.model_copy(deep=True))


def response_object(
    job: JobInfo,
    spec: ResponseSpec,
    output: list[ResponseOutputItem],
    usage: Usage | None,
    finish_reason: str | None,
    status: str | None = None,
    error: dict | None = None,
) -> Response:
    """The response as it stands: in progress without usage, else completed or incomplete (or `status`)."""
    status = status or (
        "in_progress"
        if usage is None
        else "incomplete"
        if finish_reason == "length"
        else "completed"
    )
    return Response(
        id=response_id(job),
        created_at=job.created,
        model=job.model,
        output=output,
        status=status,
        error=error,
        incomplete_details=IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete"
        else None,
        **spec.fields,
        usage=None
        if usage is None
        else ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        ),
    )


def assistant_turn(response: Response) -> dict:
    """The response's output as the chat message a next turn continues from."""
    text = "".join(
        p.text
        for item in response.output
        if isinstance(item, ResponseOutputMessage)
        for p in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {
                "name": offered_name(item.namespace, item.name),
                "arguments": item.arguments,
            },
        }
        for item in response.output
        if isinstance(item, ResponseFunctionToolCall)
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def response(
    job: JobInfo,
    spec: ResponseSpec,
    choice: GatheredChoice,
    usage: Usage,
    parser: parsers.ToolCallParser | None,
) -> Response:
    output = Output(job, parser, spec)
    for _ in [*output.feed(choice.text), *output.finish(choice.finish_reason == "length")]:
        pass
    return response_object(job, spec, output.items, usage, choice.finish_reason)


def folded(
    job: JobInfo, spec: ResponseSpec, events: Iterable[Event], parser: parsers.ToolCallParser | None
) -> Response:
    """The response as a job's events so far make it (a background response being polled): queued
    until the node takes the job, in progress with the output so far, then completed or incomplete,
    failed (with the error), or cancelled."""
    output, finish_reason, status = Output(job, parser, spec), None, "queued"
    for event in events:
        status = "in_progress"
        if isinstance(event, DoneEvent):
            for _ in output.finish(finish_reason == "length"):
                pass
            return response_object(job, spec, output.items, event.usage, finish_reason)
        if isinstance(event, ErrorEvent):
            cancelled = event.code == JobCancelled.code
            return response_object(
                job,
                spec,
                output.items,
                None,
                None,
                status="cancelled" if cancelled else "failed",
                error=None if cancelled else {"code": event.code, "message": event.message},
            )
        if not isinstance(event, StartEvent):
            for delta in event.choices:
                for _ in output.feed(delta.text):
                    pass
                finish_reason = delta.finish_reason or finish_reason
    return response_object(job, spec, output.items, None, None, status=status)


async def response_events(
    job: JobInfo,
    spec: ResponseSpec,
    events: AsyncIterator[DeltaEvent | DoneEvent],
    parser: parsers.ToolCallParser | None,
) -> AsyncIterator[ResponseStreamEvent]:
    """response.created, response.in_progress, the output items' events, then response.completed
    (or response.incomplete when max_output_tokens cut it), numbered in order."""
    numbers = count()

    def numbered(event: ResponseStreamEvent) -> ResponseStreamEvent:
        event.sequence_number = next(numbers)
        return event

    started = response_object(job, spec, [], None, None)
    yield numbered(ResponseCreatedEvent(response=started))
    yield numbered(ResponseInProgressEvent(response=started))
    output, finish_reason = Output(job, parser, spec), None
    async for event in events:
        if isinstance(event, DoneEvent):
            for item_event in output.finish(finish_reason == "length"):
                yield numbered(item_event)
            final = response_object(job, spec, output.items, event.usage, finish_reason)
            end = (
                ResponseIncompleteEvent if final.status == "incomplete" else ResponseCompletedEvent
            )
            yield numbered(end(response=final))
            return
        for delta in event.choices:
            for item_event in output.feed(delta.text):
                yield numbered(item_event)
            finish_reason = delta.finish_reason or finish_reason
