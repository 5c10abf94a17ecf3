"""The continuous-batching engine for one model. Everything here runs on the device thread.

Each `step()` reads admit -> prefill (one chunk group) -> decode (one token for every running
sequence) -> retire, and returns the step's events for every job at once. Running sequences
occupy cache rows 0..n-1: decoding rows first, then rows still reading their prompt, so each
forward works on a contiguous block of a static cache. The decode forward is the fixed-shape
step of node_agent/model/forward.py, run by a decoder (node_agent/model/decoders.py: eager, or padded to a
bucket and replayed from a CUDA graph); sampling runs on the device for all rows together
(node_agent/model/sampling.py). A step costs one copy in, one forward, one copy out of the chosen ids,
then per row the detokeniser and stop checks. Events are plain wire dicts (shared/wire.py), one
list per job per step: no object per token. A prompt with images is embedded once, at admission
(node_agent/model/vision.py), and prefilled from slices of its embeddings like text.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from node_agent.engine import constrain
from node_agent.model import decoders
from node_agent.engine.detokenize import IncrementalDetokenizer, StopStrings
from node_agent.model.loader import LoadedModel
from node_agent.model.model_calls import ModelCalls, slot_cache, weight_bytes
from node_agent.model.vision import VisionPrompt, embed_prompt
from node_agent.model.sampling import SlotSampling, sample, stages, token_logprobs
from shared import wire
from shared.catalog import ModelProfile
from shared.errors import ContextLengthExceeded, CortexError, GenerationFailed, InvalidRequest
from shared.lifecycle import FinishReason
from shared.wire import DoneEvent, ErrorEvent, GenerationRequest, SamplingParams, Timings, Usage

log = logging.getLogger(__name__)


def _now_ms() -> float:
    return time.time() * 1000


@dataclass
class Sequence:
    job: "Job"
    index: int
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    output_ids: list[int] = field(default_factory=list)
    prefilled: int = 0
    finish_reason: str | None = None
    matcher: object | None = None  # an llguidance matcher when the request has a grammar
    prompt_logprobs: list[dict] | None = None  # wire PromptLogprob entries, when asked; sent on the first delta

    @property
    def cached_len(self) -> int:
        """Cache columns this sequence has written."""
        return self.prefilled + max(len(self.output_ids) - 1, 0)

    @property
    def prompt_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def position(self) -> int:
        """The cache column of the token the next decode step feeds (its last output)."""
        return self.prefilled + len(self.output_ids) - 1


@dataclass
class Job:
    request: GenerationRequest
    submitted_ms: float
    prompt_tokens: int
    sequences: list[Sequence] = field(default_factory=list)
    deltas: list[dict] = field(default_factory=list)  # this step's wire choice deltas, not yet emitted
    admitted_ms: float = 0.0
    first_token_ms: float = 0.0
    error: CortexError | None = None  # a failure of its own (one row's host work raised): sent instead of deltas
    images: dict[str, np.ndarray] | None = None  # a vision prompt's processor inputs, until embedded at admission
    vision: VisionPrompt | None = None  # its embeddings (and rope positions), shared by its sequences

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
        self.slots = profile.slots
        self.vocab = loaded.model.config.get_text_config().vocab_size
        self.cache = slot_cache(loaded, profile)
        self.max_len = self.cache.max_len
        # every model call goes through here (to all ranks of a tensor-parallel model)
        self.calls = (loaded.group.calls(loaded.model, self.cache) if loaded.group
                      else ModelCalls(loaded.model, self.cache))
        self.sampling = SlotSampling(self.slots, self.vocab, loaded.device)
        self.rope_offsets = torch.zeros(self.slots, dtype=torch.long, device=loaded.device)  # forward.py; moved with rows
        self.decoder = decoders.make(profile.decode, loaded.model, self.cache, self.rope_offsets, self.slots,
                                     self.calls.step)
        self.resident_bytes = weight_bytes(loaded.model) + self.cache.bytes + self.sampling.bytes
        self.eos_ids = self._eos_ids()
        self.grammars = constrain.Grammars(loaded.tokenizer, self.vocab, self.eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # rows[:n_decoding] decode; the rest are reading their prompt
        self.n_decoding = 0
        self.jobs: dict[str, Job] = {}
        log.info("%s decodes with %s steps", profile.id, self.decoder.name)

    def _eos_ids(self) -> set[int]:
        ids = {self.lm.tokenizer.eos_token_id}
        configured = getattr(self.lm.model.generation_config, "eos_token_id", None)
        ids |= set(configured if isinstance(configured, list) else [configured])
        return {i for i in ids if i is not None}

    def memory_bytes(self) -> int:
        """Weights, KV cache, sampling state and captured graphs: what this replica holds on its
        device. Plain numbers, so the event loop may read it without touching the device."""
        return self.resident_bytes + self.decoder.graph_bytes

    def release(self) -> None:
        """Drop every tensor (on unload), and a tensor-parallel model's other ranks."""
        self.fail_all()
        self.calls.close()
        self.cache = self.sampling = self.decoder = self.calls = None
        self.lm.model = None

    # ---- admission -------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    def add(self, request: GenerationRequest, prompt_ids: list[int], submitted_ms: float,
            images: dict[str, np.ndarray] | None = None) -> None:
        """Queue a job whose prompt is already tokenised and checked with `check_fits`; `images`: a
        vision model's processor inputs for the prompt's images (node_agent/prompts.vision_prompt)."""
        params = request.sampling
        self._check_token_ids(prompt_ids, params)
        room = self.max_len - len(prompt_ids)
        job = Job(request=request, submitted_ms=submitted_ms, prompt_tokens=len(prompt_ids), images=images or None)
        for index in range(params.n):
            job.sequences.append(Sequence(
                job=job, index=index, prompt_ids=prompt_ids, max_tokens=params.max_tokens or room, params=params,
                seed=None if params.seed is None else params.seed + index,
                detokenizer=IncrementalDetokenizer(self.lm.tokenizer), stops=StopStrings(params.stop),
                matcher=self.grammars.matcher(params.grammar) if params.grammar else None,
                prompt_logprobs=None if params.prompt_logprobs is None else [
                    {"token": self.lm.tokenizer.decode([prompt_ids[0]]), "logprob": None, "top_logprobs": []}],
            ))
        self.jobs[job.id] = job
        self.waiting.extend(job.sequences)

    def _check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Token ids the request names must exist in this model's vocabulary."""
        for what, ids in (("prompt", prompt_ids), ("logit_bias", params.logit_bias)):
            bad = next((i for i in ids if not 0 <= i < self.vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{what} names token id {bad}, outside this model's vocabulary "
                                     f"(0..{self.vocab - 1})", param=what)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: give at least one token", param="prompt")

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

    def _fail_job(self, job: Job, exc: Exception) -> None:
        """One job's own work raised: end its sequences (retired with the step) and send the error."""
        log.exception("job %s failed in its own host work; the other rows go on", job.id)
        job.error = GenerationFailed(f"{type(exc).__name__}: {exc}")
        for seq in job.sequences:
            seq.finish_reason = seq.finish_reason or FinishReason.ERROR
        self.waiting = deque(s for s in self.waiting if s.job is not job)

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
    def step(self) -> list[tuple[str, list[dict]]]:
        """Run one engine step; returns (job id, wire events) for every job that has news."""
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
            if seq.job.images is not None and not self._embed_images(seq.job):
                continue
            self.sampling.assign(len(self.rows), seq.params, seq.prompt_ids, seq.seed)
            self.rope_offsets[len(self.rows)] = seq.job.vision.rope_delta if seq.job.vision else 0
            self.rows.append(seq)

    def _embed_images(self, job: Job) -> bool:
        """Run the vision tower for a job's prompt once (its first sequence admitted); False if that failed."""
        try:
            job.vision = embed_prompt(self.lm.model, job.sequences[0].prompt_ids, job.images, self.lm.device)
            longest = max((end - start for start, end in job.vision.blocks), default=0)
            if longest > self.profile.prefill_chunk_tokens:
                raise InvalidRequest(f"an image of {longest} tokens does not fit one prefill chunk "
                                     f"(prefill_chunk_tokens = {self.profile.prefill_chunk_tokens})")
        except Exception as exc:
            self._fail_job(job, exc)
            return False
        job.images = None
        return True

    def _prefill(self) -> None:
        """Read the next chunk of waiting prompts, several sequences together, up to the budget.
        Chunks are right-padded to the widest; a model with linear-attention layers would fold
        that padding into its recurrent state, so it groups only chunks of the first one's width."""
        budget, group, chunks = self.profile.prefill_chunk_tokens, [], []
        for seq in self.rows[self.n_decoding:]:
            if budget <= 0:
                break
            chunk = min(len(seq.prompt_ids) - seq.prefilled, budget)
            if seq.job.vision is not None:
                chunk = seq.job.vision.chunk(seq.prefilled, chunk)
            if chunks and self.cache.has_linear_attention and chunk != chunks[0]:
                break
            group.append(seq)
            chunks.append(chunk)
            budget -= chunk
        if not group:
            return
        start, width = self.n_decoding, max(chunks)
        input_ids = torch.zeros(len(group), width, dtype=torch.long)
        positions = torch.zeros(len(group), width, dtype=torch.long)
        write_pos = torch.full((len(group), width), self.cache.scratch_column, dtype=torch.long)
        for i, (seq, chunk) in enumerate(zip(group, chunks)):
            input_ids[i, :chunk] = torch.tensor(seq.prompt_ids[seq.prefilled: seq.prefilled + chunk])
            positions[i] = torch.arange(seq.prefilled, seq.prefilled + width).clamp(max=self.max_len - 1)
            write_pos[i, :chunk] = positions[i, :chunk]
        kv_len = min(max(s.prefilled + c for s, c in zip(group, chunks)), self.max_len)
        device = self.lm.device
        input_ids, positions = input_ids.to(device), positions.to(device)
        inputs_embeds, rope_positions, sees_until = self._vision_inputs(group, chunks, input_ids, positions)
        hidden = self.calls.forward(slice(start, start + len(group)), input_ids, positions, write_pos.to(device), kv_len,
                                    inputs_embeds=inputs_embeds, rope_positions=rope_positions, sees_until=sees_until)
        for i, (seq, chunk) in enumerate(zip(group, chunks)):
            if seq.prompt_logprobs is not None and seq.job.error is None:
                try:
                    self._score_prompt(seq, hidden[i, :chunk])
                except Exception as exc:
                    self._fail_job(seq.job, exc)
            seq.prefilled += chunk
        done = [i for i, seq in enumerate(group) if seq.prompt_done]  # a prefix of the group
        if done:
            last = hidden[torch.tensor(done, device=device), torch.tensor([chunks[i] - 1 for i in done], device=device)]
            seqs = [group[i] for i in done]
            self._sample_and_emit(seqs, self.calls.logits(last), slice(start, start + len(done)),
                                  [s.prefilled - 1 for s in seqs])
            self.n_decoding += len(done)

    def _vision_inputs(self, group: list[Sequence], chunks: list[int], input_ids: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """A chunk group's embeddings, rope positions and last positions seen, where some row reads
        a prompt with images (its chunk's slice of each; the other rows embed their tokens and see
        causally); Nones otherwise."""
        rows = [(i, seq.job.vision, seq.prefilled, chunk) for i, (seq, chunk) in enumerate(zip(group, chunks))
                if seq.job.vision is not None]
        if not rows:
            return None, None, None
        embeds = self.lm.model.get_input_embeddings()(input_ids)
        for i, prompt, start, chunk in rows:
            embeds[i, :chunk] = prompt.embeds[start: start + chunk]
        rope = sees_until = None
        if any(prompt.rope is not None for _, prompt, _, _ in rows):
            rope = positions[None].repeat(3, 1, 1)
            for i, prompt, start, chunk in rows:
                if prompt.rope is not None:
                    rope[:, i, :chunk] = prompt.rope[:, start: start + chunk]
        if any(prompt.sees_until is not None for _, prompt, _, _ in rows):
            sees_until = positions.clone()
            for i, prompt, start, chunk in rows:
                if prompt.sees_until is not None:
                    sees_until[i, :chunk] = prompt.sees_until[start: start + chunk]
        return embeds, rope, sees_until

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Prompt logprobs for this chunk: each position scores the prompt token that follows it."""
        following = seq.prompt_ids[seq.prefilled + 1: seq.prefilled + hidden.shape[0] + 1]
        if not following:
            return
        logits = self.calls.logits(hidden[: len(following)])
        chosen, tops = token_logprobs(logits, torch.tensor(following, device=logits.device), seq.params.prompt_logprobs)
        seq.prompt_logprobs += [self._logprob_entry(token, lp, top) for token, lp, top in zip(following, chosen, tops)]

    def _decode(self) -> None:
        rows = self.rows[: self.n_decoding]
        if not rows:
            return
        positions, tokens = [s.position for s in rows], [s.output_ids[-1] for s in rows]
        try:
            logits = self.decoder(tokens, positions)
        except decoders.CaptureFailed as exc:
            log.warning("%s: the decode step cannot be captured (%s); decoding eagerly from now on", self.profile.id, exc)
            self.decoder = decoders.EagerDecoder(self.lm.model, self.cache, self.rope_offsets)
            logits = self.decoder(tokens, positions)
        self._sample_and_emit(rows, logits, slice(0, len(rows)), positions)

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor, rows: slice, positions: list[int]) -> None:
        use = stages([s.params for s in seqs])
        raw = logits
        if any(s.matcher is not None for s in seqs):
            logits = logits.clone()
            constrain.apply_masks(logits, [s.matcher for s in seqs])
        noise_at = torch.tensor(positions, device=logits.device) if use.sampling else None
        tokens = sample(logits, self.sampling, rows, noise_at, use)
        if use.penalties:
            self.sampling.record(rows, tokens)
        ids = tokens.tolist()  # the step's one device->host copy
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs]
        logprobs = self._logprobs(raw, tokens, ids, asked, [seqs[i] for i in asked]) if asked else {}
        now = _now_ms()
        for i, (seq, token) in enumerate(zip(seqs, ids)):
            seq.job.first_token_ms = seq.job.first_token_ms or now
            try:
                if seq.matcher is not None and not constrain.advance(seq.matcher, token):
                    seq.matcher = None
                self._advance(seq, token, logprobs.get(i))
            except Exception as exc:  # this row's host work (grammar, detokeniser, stops): its job alone fails
                self._fail_job(seq.job, exc)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, ids: list[int], asked: list[int],
                  seqs: list[Sequence]) -> dict[int, dict]:
        """Wire logprob entries for the rows that asked (by their index in the batch)."""
        index = torch.tensor(asked, device=raw.device)
        top_n = max(s.params.top_logprobs for s in seqs)
        chosen, tops = token_logprobs(raw[index], tokens[index], top_n)
        return {i: self._logprob_entry(ids[i], lp, top[: seq.params.top_logprobs])
                for i, seq, lp, top in zip(asked, seqs, chosen, tops)}

    def _logprob_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """A wire `TokenLogprob` (or `PromptLogprob`): the token, its logprob and its best alternatives."""
        return self._top_entry(token, logprob) | {"top_logprobs": [self._top_entry(t, v) for t, v in top]}

    def _top_entry(self, token: int, logprob: float) -> dict:
        text = self.lm.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _advance(self, seq: Sequence, token: int, logprob: dict | None) -> None:
        seq.output_ids.append(token)
        params = seq.params
        stop_sequence = None
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            text, seq.finish_reason = seq.stops.flush(), FinishReason.STOP
        else:
            text, hit_stop = seq.stops.feed(seq.detokenizer.add(token))
            if hit_stop:
                seq.finish_reason, stop_sequence = FinishReason.STOP, seq.stops.matched
            elif len(seq.output_ids) >= seq.max_tokens:
                text, seq.finish_reason = text + seq.stops.flush(), FinishReason.LENGTH
        prompt_logprobs = seq.prompt_logprobs if len(seq.output_ids) == 1 else None
        seq.job.deltas.append(wire.choice_delta(seq.index, text, token, logprob, seq.finish_reason, stop_sequence,
                                                prompt_logprobs))

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
                self.calls.move_row(src, dst, seq.cached_len)
                self.sampling.move(src, dst)
                self.rope_offsets[dst] = self.rope_offsets[src]
        self.rows, self.n_decoding = new_rows, len(keep_decoding)

    def _collect_events(self) -> list[tuple[str, list[dict]]]:
        out = []
        for job in [j for j in self.jobs.values() if j.error is not None]:
            del self.jobs[job.id]
            out.append((job.id, [ErrorEvent(code=job.error.code, message=job.error.message).model_dump()]))
        for job in [j for j in self.jobs.values() if j.deltas]:
            events = [wire.delta_event(job.deltas)]
            job.deltas = []
            if job.finished:
                events.append(self._done(job))
                del self.jobs[job.id]
            out.append((job.id, events))
        return out

    def _done(self, job: Job) -> dict:
        now = _now_ms()
        return DoneEvent(
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=sum(len(s.output_ids) for s in job.sequences)),
            timings=Timings(queue_ms=max(job.admitted_ms - job.submitted_ms, 0.0),
                            prefill_ms=job.first_token_ms - job.admitted_ms, decode_ms=now - job.first_token_ms),
            node=self.node,
        ).model_dump()
