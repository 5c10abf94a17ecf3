"""The output processor: turns what the runner sampled into each job's wire events. It owns every
sequence's text side: the incremental detokeniser, stop strings, the grammar matcher (its mask for
the next step, and the token fed back), max_tokens, logprob entries; and each job's timings and
usage. It decides which sequences finished; the scheduler frees them (vLLM v1's OutputProcessor,
here on the device thread, between two steps).
"""

import logging
import time
from dataclasses import dataclass, field

import llguidance
import torch

from node_agent.engine import constrain
from node_agent.engine.detokenize import IncrementalDetokenizer, StopStrings
from node_agent.model.step import PromptScores, Sampled
from shared.errors import CortexError, GenerationFailed
from shared.lifecycle import FinishReason
from shared.wire import (ChoiceDelta, DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest, PromptLogprob, StepEvents,
                         Timings, TokenLogprob, TopLogprob, Usage)

log = logging.getLogger(__name__)


def _now_ms() -> float:
    return time.time() * 1000


@dataclass(eq=False)
class SequenceOutput:
    job: "JobOutput"
    index: int
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    matcher: llguidance.LLMatcher | None = None  # when the request has a grammar
    prompt_logprobs: list[PromptLogprob] | None = None  # when asked; sent on the first delta
    tokens: int = 0
    finish_reason: str | None = None


@dataclass(eq=False)
class JobOutput:
    request: GenerationRequest
    submitted_ms: float
    prompt_tokens: int
    sequences: list[SequenceOutput] = field(default_factory=list)
    deltas: list[ChoiceDelta] = field(default_factory=list)  # this step's choice deltas, not yet emitted
    admitted_ms: float = 0.0
    first_token_ms: float = 0.0
    cached_tokens: int = 0  # of its prompt, read from the prefix cache
    error: CortexError | None = None  # a failure of its own: sent instead of deltas

    @property
    def id(self) -> str:
        return self.request.job

    @property
    def finished(self) -> bool:
        return all(s.finish_reason for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer, grammars: constrain.Grammars, eos_ids: set[int], node: str):
        self.tokenizer, self.grammars, self.eos_ids, self.node = tokenizer, grammars, eos_ids, node
        self.jobs: dict[str, JobOutput] = {}
        self.sequences: dict[int, SequenceOutput] = {}  # by the scheduler's sequence key

    def add(self, request: GenerationRequest, prompt_ids: list[int], submitted_ms: float, keys: list[int],
            max_tokens: int) -> None:
        """A job's sequences (by the scheduler's keys); raises InvalidRequest for a grammar that cannot be used."""
        params = request.sampling
        matchers = [self.grammars.matcher(params.grammar) if params.grammar else None for _ in keys]
        job = JobOutput(request, submitted_ms, len(prompt_ids))
        for index, (key, matcher) in enumerate(zip(keys, matchers)):
            seq = SequenceOutput(job, index, max_tokens, IncrementalDetokenizer(self.tokenizer),
                                 StopStrings(params.stop), matcher,
                                 None if params.prompt_logprobs is None else [self._first_prompt_entry(prompt_ids[0])])
            job.sequences.append(seq)
            self.sequences[key] = seq
        self.jobs[job.id] = job

    def forget(self, keys: list[int]) -> None:
        """Sequences the scheduler let go of (their job's last events are collected already)."""
        for key in keys:
            self.sequences.pop(key, None)

    def drop(self, job_id: str, keys: list[int]) -> None:
        """A cancelled job: no more events."""
        self.jobs.pop(job_id, None)
        self.forget(keys)

    def admitted(self, cached_tokens: dict[str, int]) -> None:
        """Jobs whose sequences took rows this step, with the prompt tokens their first found cached."""
        now = _now_ms()
        for job_id, cached in cached_tokens.items():
            if (job := self.jobs.get(job_id)) is not None:
                job.admitted_ms, job.cached_tokens = job.admitted_ms or now, job.cached_tokens or cached

    def bitmask(self, keys: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar masks of the rows about to be sampled (`keys`, in row order), where some has a grammar."""
        return self.grammars.bitmask([self.sequences[key].matcher for key in keys])

    def fail_job(self, job_id: str, exc: Exception) -> None:
        """One job's own work raised: end its sequences and send the error instead of its deltas."""
        job = self.jobs.get(job_id)
        if job is None or job.error is not None:
            return
        log.error("job %s failed in its own work (%s: %s); the other rows go on", job_id, type(exc).__name__, exc)
        job.error = exc if isinstance(exc, CortexError) else GenerationFailed(f"{type(exc).__name__}: {exc}")
        for seq in job.sequences:
            seq.finish_reason = seq.finish_reason or FinishReason.ERROR

    def scores(self, key: int, scores: PromptScores) -> None:
        seq = self.sequences.get(key)
        if seq is None or seq.prompt_logprobs is None:
            return
        del seq.prompt_logprobs[scores.start + 1:]  # a sequence preempted while reading reads it again
        seq.prompt_logprobs += [self._prompt_logprob(token, lp, top)
                                for token, lp, top in zip(scores.tokens, scores.logprobs, scores.tops)]

    def sampled(self, keys: list[int], sampled: list[Sampled]) -> None:
        now = _now_ms()
        for key, out in zip(keys, sampled):
            seq = self.sequences[key]
            if seq.finish_reason:
                continue
            seq.job.first_token_ms = seq.job.first_token_ms or now
            try:
                if seq.matcher is not None and not constrain.advance(seq.matcher, out.token):
                    seq.matcher = None
                logprob = self._token_logprob(out.token, out.logprob, out.top) if out.logprob is not None else None
                self._advance(seq, out.token, logprob)
            except Exception as exc:  # this row's host work (grammar, detokeniser, stops): its job alone fails
                log.exception("job %s: a sequence's output could not be processed", seq.job.id)
                self.fail_job(seq.job.id, exc)

    def finished(self) -> list[int]:
        """Keys of the sequences that finished (or whose job failed) and are still known."""
        return [key for key, seq in self.sequences.items() if seq.finish_reason]

    def _advance(self, seq: SequenceOutput, token: int, logprob: TokenLogprob | None) -> None:
        seq.tokens += 1
        params = seq.job.request.sampling
        stop_sequence = None
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            text, seq.finish_reason = seq.stops.flush(), FinishReason.STOP
        else:
            text, hit_stop = seq.stops.feed(seq.detokenizer.add(token))
            if hit_stop:
                seq.finish_reason, stop_sequence = FinishReason.STOP, seq.stops.matched
            elif seq.tokens >= seq.max_tokens:
                text, seq.finish_reason = text + seq.stops.flush(), FinishReason.LENGTH
        prompt_logprobs = seq.prompt_logprobs if seq.tokens == 1 else None
        seq.job.deltas.append(ChoiceDelta(
            index=seq.index, text=text, token_ids=[token], logprobs=None if logprob is None else [logprob],
            prompt_logprobs=prompt_logprobs, finish_reason=seq.finish_reason, stop_sequence=stop_sequence))

    def collect(self) -> StepEvents:
        """Every job's events of this step; a job that ended is forgotten after."""
        out = []
        for job in list(self.jobs.values()):
            if job.error is not None:
                out.append((job.id, [ErrorEvent(code=job.error.code, message=job.error.message)]))
            elif job.deltas:
                events = [DeltaEvent(choices=job.deltas)]
                job.deltas = []
                if job.finished:
                    events.append(self._done(job))
                out.append((job.id, events))
            else:
                continue
            if job.error is not None or job.finished:
                del self.jobs[job.id]
        return out

    def _done(self, job: JobOutput) -> DoneEvent:
        now = _now_ms()
        return DoneEvent(
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=sum(s.tokens for s in job.sequences),
                        cached_tokens=job.cached_tokens),
            timings=Timings(queue_ms=max(job.admitted_ms - job.submitted_ms, 0.0),
                            prefill_ms=job.first_token_ms - job.admitted_ms, decode_ms=now - job.first_token_ms),
            node=self.node,
        )

    def _first_prompt_entry(self, token: int) -> PromptLogprob:
        return PromptLogprob(token=self.tokenizer.decode([token]), logprob=None)

    def _prompt_logprob(self, token: int, logprob: float, top: list[tuple[int, float]]) -> PromptLogprob:
        return PromptLogprob(token=self.tokenizer.decode([token]), logprob=logprob,
                             top_logprobs=[self._top(t, v) for t, v in top])

    def _token_logprob(self, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        """The token, its logprob and its best alternatives."""
        text = self.tokenizer.decode([token])
        return TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                            top_logprobs=[self._top(t, v) for t, v in top])

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
