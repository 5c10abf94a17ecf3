"""A read's stream entries into engine requests: each entry is decoded, admitted to the ledger,
rendered and tokenised (in the thread pool), checked against the context and the device's free
memory, announced (its start event) and handed to the engine on the device thread with the rest of
its read. An entry that cannot run ends here with an error in its dialect's terms; nothing it does
reaches another job."""

import asyncio
import logging
import time

import numpy as np

from node_agent.engine.engine import Engine, check_fits
from node_agent.engine.scheduler import Share
from node_agent.serving import prompts
from node_agent.serving.completion_budget import completion_budget
from node_agent.serving.device_thread import DeviceThread
from node_agent.serving.job_reader import Entry
from node_agent.serving.job_spans import JobSpans
from node_agent.serving.ledger import Ledger, Running, Send
from node_agent.serving.output_messages import Delivery, Outgoing
from shared.catalog import ModelProfile
from shared.errors import CortexError, GenerationFailed, InsufficientMemory, InvalidRequest
from shared.settings import NodeSettings
from shared.wire import DoneEvent, GenerationRequest, StartEvent, StreamEntry, Usage

log = logging.getLogger(__name__)

Prepared = tuple[
    GenerationRequest, list[int], float, dict[str, np.ndarray], Share
]  # request, prompt ids, submitted, images, whose share of the rows it takes


def add_each(engine: Engine, jobs: list[Prepared]) -> list[tuple[str, CortexError]]:
    """On the device thread: add each job; returns the jobs the engine refused, with why."""
    refused = []
    for request, ids, submitted_ms, images, share in jobs:
        try:
            engine.add(request, ids, submitted_ms, images, share)
        except CortexError as exc:
            refused.append((request.job, exc))
        except Exception as exc:
            log.exception("job %s could not start", request.job)
            refused.append((request.job, GenerationFailed(f"{type(exc).__name__}: {exc}")))
    return refused


class Intake:
    def __init__(
        self,
        profile: ModelProfile,
        settings: NodeSettings,
        node: str,
        device: DeviceThread,
        ledger: Ledger,
        send: Send,
    ):
        self.profile, self.settings, self.node, self.device = profile, settings, node, device
        self.ledger, self._send = ledger, send
        self.engine: Engine | None = None
        self.max_prompt_chars: int | None = (
            None  # longer prompts cannot fit: refused before tokenising
        )

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        max_tokens = min(engine.max_len, self.profile.max_prompt_tokens or engine.max_len)
        self.max_prompt_chars = max_tokens * prompts.longest_token_chars(engine.tokenizer)

    async def add(self, jobs: list[Prepared]) -> None:
        """Hand a read's prepared jobs to the engine in one call: a wave of arrivals joins one prefill
        step instead of trickling in one step at a time."""
        if jobs:
            for job, error in await self.device.call(add_each, self.engine, jobs):
                self.ledger.fail(job, error)

    async def prepare(self, e: Entry) -> Prepared | None:
        """Decode, render, tokenise and check one entry; returns what the engine needs, or None
        when the entry ended here (refused, failed, or a count that needs no engine)."""
        stream = e.stream or self.ledger.stream
        channel = StreamEntry.channel_of(e.fields)
        try:
            entry = StreamEntry.from_fields(e.fields)
            request = entry.request()
        except (
            Exception
        ) as exc:  # WireError, or bytes that are not even text: the entry alone is refused
            log.error(
                "refusing entry %s on %s: %s: %s", e.entry_id, stream, type(exc).__name__, exc
            )
            self.ledger.refuse(
                e.entry_id, channel, InvalidRequest(f"an unreadable job entry: {exc}"), stream
            )
            return None
        trace = JobSpans.of(entry, e.entry_id, self.node)
        self.ledger.admit(
            request.job,
            Running(
                e.entry_id,
                entry.channel,
                request.sampling.n,
                entry.keep_alive_s,
                stream=stream,
                job_class=e.job_class,
                streaming=bool(entry.streaming),
                trace=trace,
                api_key=entry.api_key or "",
                tenant=entry.tenant or "",
            ),
        )
        log.info(
            "job=%s request=%s admitted from %s%s%s",
            request.job,
            entry.request_id,
            e.entry_id,
            " as a newcomer (beyond the slots)" if e.newcomer else "",
            f" trace={entry.traceparent.split('-')[1]}" if entry.traceparent else "",
        )
        try:
            self._check_memory()
            tokenizing_ns = time.time_ns()
            ids, images = await asyncio.to_thread(self._prompt, request)
            if trace is not None:
                trace.tokenized_ns = (tokenizing_ns, time.time_ns())
            if request.kind == "count":  # count_tokens: the rendered prompt's length; nothing runs
                self._send(
                    [
                        Outgoing(
                            entry.channel,
                            [DoneEvent(usage=Usage(prompt_tokens=len(ids)), node=self.node)],
                            (stream, e.entry_id),
                        )
                    ],
                    [],
                )
                self.ledger.end(request.job)
                return None
            sampling = request.sampling
            sampling.max_tokens = completion_budget(
                self.profile, self.engine.max_len, len(ids), sampling.max_tokens
            )
            check_fits(
                self.engine.max_len, len(ids), sampling.max_tokens, self.profile.max_prompt_tokens
            )
            self._send(
                [Outgoing(entry.channel, [self._start_event(request, ids)], job=request.job)],
                [
                    Delivery(
                        request.job,
                        entry.channel,
                        stream,
                        e.entry_id,
                        bool(entry.streaming),
                        api_key=entry.api_key or "",
                    )
                ],
            )
            share = Share(entry.tenant or "", e.newcomer)
            return request, ids, float(entry.submitted_ms), images, share
        except Exception as exc:
            self.failed(request.job, exc)
        return None

    def failed(self, job: str, exc: Exception) -> None:
        """A job that could not start fails with its error (a bug's: generation_failed, logged)."""
        if not isinstance(exc, CortexError):
            log.exception("job %s could not start", job)
            exc = GenerationFailed(f"{type(exc).__name__}: {exc}")
        self.ledger.fail(job, exc)

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], dict[str, np.ndarray]]:
        """In the thread pool: the prompt's token ids, and a vision model's image inputs for it."""
        engine = self.engine
        if engine.processor is not None:
            return prompts.vision_prompt(
                engine.processor, self.profile, request, self.max_prompt_chars
            )
        return prompts.prompt_ids(
            engine.tokenizer, self.profile, request, self.max_prompt_chars
        ), {}

    def _start_event(self, request: GenerationRequest, ids: list[int]) -> StartEvent:
        echo = request.echo and isinstance(
            request.prompt, list
        )  # a text prompt the gateway echoes itself
        return StartEvent(
            prompt_tokens=len(ids), prompt_text=self.engine.tokenizer.decode(ids) if echo else None
        )

    def _check_memory(self) -> None:
        free = self.device.last_info.free_mb if self.device.last_info else None
        if free is not None and free < self.settings.min_free_mb:
            raise InsufficientMemory(
                f"{self.device.device} on {self.node} has {free} MB free, "
                f"below min_free_mb={self.settings.min_free_mb}"
            )
