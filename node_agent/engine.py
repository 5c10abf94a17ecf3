"""The continuous-batching engine for one model. Everything here runs on the device thread.

Each `step()` reads admit -> prefill (one chunk group) -> decode (one token for every running
sequence) -> retire, and returns the step's events for every job at once. Running sequences
occupy cache rows 0..n-1: decoding rows first, then rows still reading their prompt, so each
forward works on a contiguous block of a static cache.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from node_agent import constrain
from node_agent.detokenize import IncrementalDetokenizer, StopStrings
from node_agent.kv_cache import SlotKVCache
from node_agent.loader import LoadedModel
from node_agent.sampling import Row, sample, token_logprobs
from shared.catalog import ModelProfile
from shared.errors import ContextLengthExceeded
from shared.lifecycle import FinishReason
from shared.wire import ChoiceDelta, DeltaEvent, DoneEvent, GenerationRequest, Timings, TokenLogprob, TopLogprob, Usage

log = logging.getLogger(__name__)

KV_BUCKET = 32  # attend over cache columns rounded up to this, to keep shapes few


def _now_ms() -> float:
    return time.time() * 1000


@dataclass
class Sequence:
    job: "Job"
    index: int
    prompt_ids: list[int]
    max_tokens: int
    row: Row
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    prefilled: int = 0
    finish_reason: str | None = None
    matcher: object | None = None  # an llguidance matcher when the request has a grammar

    @property
    def output_ids(self) -> list[int]:
        return self.row.output_ids

    @property
    def cached_len(self) -> int:
        """Cache columns this sequence has written."""
        return self.prefilled + max(len(self.output_ids) - 1, 0)

    @property
    def prompt_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids)


@dataclass
class Job:
    request: GenerationRequest
    submitted_ms: float
    prompt_tokens: int
    sequences: list[Sequence] = field(default_factory=list)
    deltas: list[ChoiceDelta] = field(default_factory=list)  # this step's, not yet emitted
    admitted_ms: float = 0.0
    first_token_ms: float = 0.0

    @property
    def id(self) -> str:
        return self.request.job

    @property
    def finished(self) -> bool:
        return all(s.finish_reason for s in self.sequences)


def check_fits(max_len: int, prompt_len: int, max_tokens: int | None, max_prompt_tokens: int | None = None) -> None:
    """Refuse, as OpenAI does, a prompt (plus requested completion) longer than the context."""
    limit = min(max_len - 1, max_prompt_tokens or max_len)
    if prompt_len > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens (prompts up to {limit}). However, your "
            f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.", param="messages")
    if max_tokens is not None and prompt_len + max_tokens > max_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.", param="max_tokens")


class Engine:
    def __init__(self, loaded: LoadedModel, profile: ModelProfile, node: str = ""):
        self.lm, self.profile, self.node = loaded, profile, node
        config = loaded.model.config
        self.max_len = min(profile.max_model_len, loaded.context_len)
        self.slots = profile.slots
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(
            layers=config.num_hidden_layers, slots=self.slots,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, max_len=self.max_len, dtype=loaded.dtype, device=loaded.device,
        )
        self.eos_ids = self._eos_ids()
        self.grammars = constrain.Grammars(loaded.tokenizer, config.vocab_size, self.eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # rows[:n_decoding] decode; the rest are reading their prompt
        self.n_decoding = 0
        self.jobs: dict[str, Job] = {}
        self.generator = torch.Generator(device=loaded.device)
        self.generator.seed()

    def _eos_ids(self) -> set[int]:
        ids = {self.lm.tokenizer.eos_token_id}
        configured = getattr(self.lm.model.generation_config, "eos_token_id", None)
        ids |= set(configured if isinstance(configured, list) else [configured])
        return {i for i in ids if i is not None}

    def memory_bytes(self) -> int:
        """Weights plus KV cache: what this replica holds on its device."""
        weights = sum(t.numel() * t.element_size() for t in self.lm.model.state_dict().values()
                      if isinstance(t, torch.Tensor))
        return weights + self.cache.bytes

    def release(self) -> None:
        """Drop every tensor (on unload)."""
        self.fail_all()
        self.cache = None
        self.lm.model = None

    # ---- admission -------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    def add(self, request: GenerationRequest, prompt_ids: list[int], submitted_ms: float) -> None:
        """Queue a job whose prompt is already tokenised and checked with `check_fits`."""
        params = request.sampling
        room = self.max_len - len(prompt_ids)
        job = Job(request=request, submitted_ms=submitted_ms, prompt_tokens=len(prompt_ids))
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.lm.device)
                generator.manual_seed(params.seed + index)
            job.sequences.append(Sequence(
                job=job, index=index, prompt_ids=prompt_ids, max_tokens=params.max_tokens or room,
                row=Row(params=params, prompt_ids=prompt_ids, output_ids=[], generator=generator),
                detokenizer=IncrementalDetokenizer(self.lm.tokenizer), stops=StopStrings(params.stop),
                matcher=self.grammars.matcher(params.grammar) if params.grammar else None,
            ))
        self.jobs[job.id] = job
        self.waiting.extend(job.sequences)

    def cancel(self, job_id: str) -> bool:
        """Drop a job's sequences at the next step; no events are sent for it."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        for seq in job.sequences:
            seq.finish_reason = seq.finish_reason or FinishReason.CANCELLED
        self.waiting = deque(s for s in self.waiting if s.job is not job)
        self._retire()
        return True

    def fail_all(self) -> list[str]:
        """Forget every job (after a device error); returns their ids."""
        failed = list(self.jobs)
        self.jobs.clear()
        self.waiting.clear()
        self.rows.clear()
        self.n_decoding = 0
        return failed

    # ---- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[str, list]]:
        """Run one engine step; returns (job id, events) for every job that has news."""
        self._admit()
        self._prefill()
        self._retire()
        self._decode()
        self._retire()
        return self._collect_events()

    def _admit(self) -> None:
        now = _now_ms()
        while self.waiting and len(self.rows) < self.slots:
            seq = self.waiting.popleft()
            seq.job.admitted_ms = seq.job.admitted_ms or now
            self.rows.append(seq)

    def _prefill(self) -> None:
        """Read the next chunk of waiting prompts, several sequences together, up to the budget."""
        budget, group, chunks = self.profile.prefill_chunk_tokens, [], []
        for seq in self.rows[self.n_decoding:]:
            if budget == 0:
                break
            chunk = min(len(seq.prompt_ids) - seq.prefilled, budget)
            group.append(seq)
            chunks.append(chunk)
            budget -= chunk
        if not group:
            return
        start = self.n_decoding
        width = max(chunks)
        device = self.lm.device
        input_ids = torch.zeros(len(group), width, dtype=torch.long)
        positions = torch.zeros(len(group), width, dtype=torch.long)
        write_pos = torch.full((len(group), width), self.max_len, dtype=torch.long)  # scratch column
        for i, (seq, chunk) in enumerate(zip(group, chunks)):
            input_ids[i, :chunk] = torch.tensor(seq.prompt_ids[seq.prefilled: seq.prefilled + chunk])
            positions[i] = torch.arange(seq.prefilled, seq.prefilled + width).clamp(max=self.max_len - 1)
            write_pos[i, :chunk] = positions[i, :chunk]
        kv_len = self._kv_len(max(s.prefilled + c for s, c in zip(group, chunks)))
        hidden = self._forward(slice(start, start + len(group)), input_ids.to(device), positions.to(device),
                               write_pos.to(device), kv_len)
        for seq, chunk in zip(group, chunks):
            seq.prefilled += chunk
        done = [i for i, seq in enumerate(group) if seq.prompt_done]
        if done:
            last = torch.tensor([chunks[i] - 1 for i in done], device=device)
            self._sample_and_emit([group[i] for i in done], hidden[torch.tensor(done, device=device), last])
            self.n_decoding += len(done)  # finished prompts are the first rows of the group

    def _decode(self) -> None:
        rows = self.rows[: self.n_decoding]
        if not rows:
            return
        device = self.lm.device
        positions = torch.tensor([[s.prefilled + len(s.output_ids) - 1] for s in rows], device=device)
        input_ids = torch.tensor([[s.output_ids[-1]] for s in rows], device=device)
        hidden = self._forward(slice(0, len(rows)), input_ids, positions, positions,
                               self._kv_len(int(positions.max()) + 1))
        self._sample_and_emit(rows, hidden[:, -1])

    def _kv_len(self, needed: int) -> int:
        return min(-(-needed // KV_BUCKET) * KV_BUCKET, self.max_len)

    def _forward(self, rows: slice, input_ids, positions, write_pos, kv_len: int) -> torch.Tensor:
        """One forward over cache rows `rows`; returns the last hidden states [B, T, H]."""
        self.cache.prepare(rows, write_pos, kv_len)
        keys = torch.arange(kv_len, device=input_ids.device)
        allowed = keys[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]
        mask = torch.zeros(allowed.shape, dtype=self.lm.dtype, device=input_ids.device)
        mask.masked_fill_(~allowed, torch.finfo(self.lm.dtype).min)
        out = self.lm.model.model(input_ids=input_ids, position_ids=positions, attention_mask=mask[:, None],
                                  past_key_values=self.cache, use_cache=True)
        return out.last_hidden_state

    def _sample_and_emit(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        logits = self.lm.model.lm_head(hidden).float()
        raw = logits.clone() if any(s.row.params.logprobs for s in seqs) else None
        if any(s.matcher is not None for s in seqs):
            constrain.apply_masks(logits, [s.matcher for s in seqs])
        tokens = sample(logits, [s.row for s in seqs], self.generator)
        top_n = max(s.row.params.top_logprobs for s in seqs)
        chosen_lp, tops = token_logprobs(raw, tokens, top_n) if raw is not None else (None, None)
        now = _now_ms()
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            seq.job.first_token_ms = seq.job.first_token_ms or now
            if seq.matcher is not None and not constrain.advance(seq.matcher, token):
                seq.matcher = None
            lp = None
            if seq.row.params.logprobs:
                lp = self._logprob(token, chosen_lp[i], tops[i][: seq.row.params.top_logprobs])
            self._advance(seq, token, lp)

    def _logprob(self, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        def entry(tid: int, lp: float) -> TopLogprob:
            text = self.lm.tokenizer.decode([tid])
            return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))
        return TokenLogprob(**entry(token, logprob).model_dump(), top_logprobs=[entry(t, v) for t, v in top])

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.output_ids.append(token)
        params = seq.row.params
        stop_sequence = None
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            text, seq.finish_reason = seq.stops.flush(), FinishReason.STOP
        else:
            text, hit_stop = seq.stops.feed(seq.detokenizer.add(token))
            if hit_stop:
                seq.finish_reason, stop_sequence = FinishReason.STOP, seq.stops.matched
            elif len(seq.output_ids) >= seq.max_tokens:
                text, seq.finish_reason = text + seq.stops.flush(), FinishReason.LENGTH
        seq.job.deltas.append(ChoiceDelta(index=seq.index, text=text, token_ids=[token],
                                          logprobs=[logprob] if logprob else None,
                                          finish_reason=seq.finish_reason, stop_sequence=stop_sequence))

    def _retire(self) -> None:
        """Take finished sequences out of their rows, packing the rest down (decode rows first)."""
        keep_decoding = [s for s in self.rows[: self.n_decoding] if not s.finish_reason]
        keep_prefill = [s for s in self.rows[self.n_decoding:] if not s.finish_reason]
        new_rows = keep_decoding + keep_prefill
        if len(new_rows) == len(self.rows):
            return
        old_index = {id(s): i for i, s in enumerate(self.rows)}
        for dst, seq in enumerate(new_rows):
            src = old_index[id(seq)]
            if src != dst:
                self.cache.move_row(src, dst, seq.cached_len)
        self.rows, self.n_decoding = new_rows, len(keep_decoding)

    def _collect_events(self) -> list[tuple[str, list]]:
        out = []
        for job in [j for j in self.jobs.values() if j.deltas]:
            events: list = [DeltaEvent(choices=job.deltas)]
            job.deltas = []
            if job.finished:
                events.append(self._done(job))
                del self.jobs[job.id]
            out.append((job.id, events))
        return out

    def _done(self, job: Job) -> DoneEvent:
        now = _now_ms()
        return DoneEvent(
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=sum(len(s.output_ids) for s in job.sequences)),
            timings=Timings(queue_ms=max(job.admitted_ms - job.submitted_ms, 0.0),
                            prefill_ms=job.first_token_ms - job.admitted_ms, decode_ms=now - job.first_token_ms),
            node=self.node,
        )
