"""The output processor: turns the engine core's step records (node_agent/engine/records.py) into
each job's wire events. It owns every sequence's text side: the incremental detokeniser, stop
strings, logprob entries; and each job's timings and usage. It ends the sequences whose stop
string it meets and says which, for the core to free (vLLM v1's OutputProcessor). It needs only
the tokenizer: on a node it runs in the model's output process, away from the device.
"""

import logging
from dataclasses import dataclass, field

from node_agent.engine.detokenize import IncrementalDetokenizer, StopStrings, TokenizerText
from node_agent.engine.records import JobOpened, PromptScoresOut, StepOutput, TokenOut
from shared.errors import CortexError, GenerationFailed
from shared.lifecycle import FinishReason
from shared.wire import (
    ChoiceDelta,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    PromptLogprob,
    StepEvents,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SequenceOutput:
    job: "JobOutput"
    key: int
    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    prompt_logprobs: list[PromptLogprob] | None = None  # when asked; sent on the first delta
    tokens: int = 0
    finish_reason: str | None = None
    core_ended: bool = (
        False  # the core ended it (a token's finish, or its job failed there): nothing to hand back
    )


@dataclass(eq=False)
class JobOutput:
    id: str
    submitted_ms: float
    prompt_tokens: int
    sequences: list[SequenceOutput] = field(default_factory=list)
    deltas: list[ChoiceDelta] = field(
        default_factory=list
    )  # this step's choice deltas, not yet emitted
    admitted_ms: float = 0.0
    first_token_ms: float = 0.0
    cached_tokens: int = 0  # of its prompt, read from the prefix cache
    error: ErrorEvent | None = None  # a failure of its own: sent instead of deltas

    @property
    def finished(self) -> bool:
        return all(s.finish_reason for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerText, node: str):
        self.tokenizer, self.node = tokenizer, node
        self.jobs: dict[str, JobOutput] = {}
        self.sequences: dict[int, SequenceOutput] = {}  # by the scheduler's sequence key
        self.consumed: dict[
            str, Usage
        ] = {}  # what each job that ended in the last `process` used, done or failed

    def process(self, out: StepOutput) -> tuple[StepEvents, list[int]]:
        """One step's record: every job's events of this step, and the keys of the sequences ended
        here that the core still runs (for `Engine.stop`)."""
        self.consumed = {}
        for opened in out.opened:
            self._open(opened)
        for job_id, cached in out.admitted:
            if (job := self.jobs.get(job_id)) is not None:
                job.admitted_ms, job.cached_tokens = (
                    job.admitted_ms or out.started_ms,
                    job.cached_tokens or cached,
                )
        for scores in out.scores:
            self._scores(scores)
        for token in out.tokens:
            self._sampled(token, out.time_ms)
        for failed in out.failed:
            self.fail_job(
                failed.job, ErrorEvent(code=failed.code, message=failed.message), core_ended=True
            )
        events = self._collect(out.time_ms)
        stopped = [
            key for key, seq in self.sequences.items() if seq.finish_reason and not seq.core_ended
        ]
        for key in [key for key, seq in self.sequences.items() if seq.finish_reason]:
            del self.sequences[key]
        return events, stopped

    def drop(self, job_id: str) -> Usage | None:
        """A job that ended elsewhere (cancelled, failed on the node): no more events for it. Returns
        what it used until then (None: it never reached the engine)."""
        job = self.jobs.pop(job_id, None)
        for seq in job.sequences if job else []:
            self.sequences.pop(seq.key, None)
        return None if job is None else self._usage(job)

    def fail_job(self, job_id: str, error: ErrorEvent, core_ended: bool = False) -> None:
        """End a job's sequences and send `error` instead of its deltas."""
        job = self.jobs.get(job_id)
        if job is None or job.error is not None:
            return
        job.error = error
        for seq in job.sequences:
            seq.finish_reason = seq.finish_reason or FinishReason.ERROR
            seq.core_ended = seq.core_ended or core_ended

    def _open(self, opened: JobOpened) -> None:
        job = JobOutput(opened.job, opened.submitted_ms, opened.prompt_tokens)
        first = (
            None
            if opened.first_prompt_token is None
            else self._first_prompt_entry(opened.first_prompt_token)
        )
        for index, key in enumerate(opened.keys):
            seq = SequenceOutput(
                job,
                key,
                index,
                IncrementalDetokenizer(self.tokenizer),
                StopStrings(opened.stops),
                None if first is None else [first],
            )
            job.sequences.append(seq)
            self.sequences[key] = seq
        self.jobs[job.id] = job

    def _scores(self, scores: PromptScoresOut) -> None:
        seq = self.sequences.get(scores.key)
        if seq is None or seq.prompt_logprobs is None:
            return
        del seq.prompt_logprobs[
            scores.start + 1 :
        ]  # a sequence preempted while reading reads it again
        seq.prompt_logprobs += [
            self._prompt_logprob(token, lp, top)
            for token, lp, top in zip(scores.tokens, scores.logprobs, scores.tops)
        ]

    def _sampled(self, out: TokenOut, now_ms: float) -> None:
        seq = self.sequences.get(out.key)
        if seq is None or seq.finish_reason:  # ended here a step ago: the core had sampled on
            return
        seq.job.first_token_ms = seq.job.first_token_ms or now_ms
        seq.core_ended = out.finish is not None
        try:
            logprob = (
                self._token_logprob(out.token, out.logprob, out.top)
                if out.logprob is not None
                else None
            )
            self._advance(seq, out, logprob)
        except Exception as exc:  # this row's host work (detokeniser, stops): its job alone fails
            log.exception("job %s: a sequence's output could not be processed", seq.job.id)
            error = (
                exc
                if isinstance(exc, CortexError)
                else GenerationFailed(f"{type(exc).__name__}: {exc}")
            )
            self.fail_job(seq.job.id, ErrorEvent(code=error.code, message=error.message))

    def _advance(self, seq: SequenceOutput, out: TokenOut, logprob: TokenLogprob | None) -> None:
        seq.tokens += 1
        token, stop_sequence = out.token, None
        if out.finish == FinishReason.STOP:  # EOS or a stop token id: not part of the text
            text, seq.finish_reason = seq.stops.flush(), FinishReason.STOP
        else:
            text, hit_stop = seq.stops.feed(seq.detokenizer.add(token))
            if hit_stop:
                seq.finish_reason, stop_sequence = FinishReason.STOP, seq.stops.matched
            elif out.finish == FinishReason.LENGTH:
                text, seq.finish_reason = text + seq.stops.flush(), FinishReason.LENGTH
        prompt_logprobs = seq.prompt_logprobs if seq.tokens == 1 else None
        seq.job.deltas.append(
            ChoiceDelta(
                index=seq.index,
                text=text,
                token_ids=[token],
                logprobs=None if logprob is None else [logprob],
                prompt_logprobs=prompt_logprobs,
                finish_reason=seq.finish_reason,
                stop_sequence=stop_sequence,
            )
        )

    def _collect(self, now_ms: float) -> StepEvents:
        """Every job's events of this step; a job that ended is forgotten after."""
        out = []
        for job in list(self.jobs.values()):
            if job.error is not None:
                out.append((job.id, [job.error]))
            elif job.deltas:
                events = [DeltaEvent(choices=job.deltas)]
                job.deltas = []
                if job.finished:
                    events.append(self._done(job, now_ms))
                out.append((job.id, events))
            else:
                continue
            if job.error is not None or job.finished:
                self.consumed[job.id] = self._usage(job)
                del self.jobs[job.id]
        return out

    @staticmethod
    def _usage(job: JobOutput) -> Usage:
        return Usage(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=sum(s.tokens for s in job.sequences),
            cached_tokens=job.cached_tokens,
        )

    def _done(self, job: JobOutput, now: float) -> DoneEvent:
        return DoneEvent(
            usage=self._usage(job),
            timings=Timings(
                queue_ms=max(job.admitted_ms - job.submitted_ms, 0.0),
                prefill_ms=job.first_token_ms - job.admitted_ms,
                decode_ms=now - job.first_token_ms,
            ),
            node=self.node,
        )

    def _first_prompt_entry(self, token: int) -> PromptLogprob:
        return PromptLogprob(token=self.tokenizer.decode([token]), logprob=None)

    def _prompt_logprob(
        self, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> PromptLogprob:
        return PromptLogprob(
            token=self.tokenizer.decode([token]),
            logprob=logprob,
            top_logprobs=[self._top(t, v) for t, v in top],
        )

    def _token_logprob(
        self, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        """The token, its logprob and its best alternatives."""
        text = self.tokenizer.decode([token])
        return TokenLogprob(
            token=text,
            logprob=logprob,
            bytes=list(text.encode()),
            top_logprobs=[self._top(t, v) for t, v in top],
        )

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
