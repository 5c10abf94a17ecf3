"""The engine for one model, on its device thread: a scheduler, a model runner and an output
processor with plain records between them (vLLM v1's and mini-sglang's split).

Each `core_step()` reads schedule -> run -> token checks:
- the scheduler (node_agent/engine/scheduler.py) admits sequences by free KV blocks, reusing a
  prompt's cached prefix, preempts when decode runs out of blocks, and plans the step: rows to
  move and set up, block tables, one prefill chunk group, the decoding rows (a `StepPlan`);
- the runner (node_agent/model/runner.py) runs it on the device: the fixed-shape decode step, the
  prefill forward, sampling for every row with a next token (under the grammars' masks); it
  returns token ids and numbers;
- the core feeds the grammars and ends sequences on what needs no text (EOS, stop token ids,
  max_tokens), and returns a `StepOutput` record (node_agent/engine/records.py).
A sequence that speculates (node_agent/engine/speculation.py) may gain several tokens a step: its
draft is first cut where its grammar refuses a token, each position is masked as its grammar
would be there, and the tokens it keeps pass these checks one by one, as if sampled in turn.
The output processor (node_agent/engine/output.py) turns records into each job's wire events:
it detokenises and applies stop strings; the sequences it ends come back through `stop()`. On a
node it runs in the model's output process (node_agent/serving/output_process.py), off the
device's process; `step()` runs both here, one after the other (tests, the in-process bench).
"""

import dataclasses
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np

from node_agent.engine import constrain
from node_agent.engine.blocks import BlockPool
from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.kv_disk import DiskTier
from node_agent.engine.kv_tiers import KVTiers
from node_agent.engine.on_device import OnDevice
from node_agent.engine.output import OutputProcessor
from node_agent.engine.records import JobFailed, JobOpened, PromptScoresOut, StepOutput, TokenOut
from node_agent.engine.scheduler import Scheduler, Share
from node_agent.engine.speculation import SpeculationStats
from node_agent.model import vision
from node_agent.model.loader import LoadedModel
from node_agent.model.runner import Runner
from shared.catalog import ModelProfile
from shared.errors import (
    AdapterLoadFailed,
    ContextLengthExceeded,
    CortexError,
    GenerationFailed,
    InvalidRequest,
)
from shared.heartbeat import KVCacheStats, SpecDecodeStats
from shared.lifecycle import FinishReason
from shared.wire import GenerationRequest, SamplingParams, StepEvents

log = logging.getLogger(__name__)


def check_fits(
    max_len: int, prompt_len: int, max_tokens: int | None, max_prompt_tokens: int | None = None
) -> None:
    """Refuse, as OpenAI does, a prompt (plus requested completion) longer than the context."""
    limit = min(max_len - 1, max_prompt_tokens or max_len)
    if prompt_len > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens (prompts up to {limit}). However, your "
            f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.",
            param="messages",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
        )


class Engine(OnDevice):
    def __init__(
        self,
        loaded: LoadedModel,
        profile: ModelProfile,
        node: str = "",
        compile_cache: Path | None = None,
        kv_disk: tuple[Path, float] | None = None,
        runner: Runner | None = None,
    ):
        """`kv_disk`: the node's KV disk tier (its directory and the GB each model may keep there);
        `runner`: what runs each step's plan (default: the model's `Runner` on its device, its
        compiled decode step kept in `compile_cache`; a simulated node's is node_agent/sim/runner.py)."""
        self.lm, self.profile, self.node = loaded, profile, node
        self.runner = runner or Runner(loaded, profile, compile_cache)
        self.vocab = self.runner.vocab
        cache = self.runner.cache
        self.pool = BlockPool(cache.blocks, cache.block_size, caching=profile.prefix_caching)
        root = hashlib.blake2b(
            f"{profile.id}|{loaded.dtype}|{profile.block_size}".encode(), digest_size=16
        ).digest()
        self.scheduler = Scheduler(
            self.pool,
            max_seqs=profile.slots,
            chunk_tokens=profile.prefill_chunk_tokens,
            linear_attention=cache.has_linear_attention,
            root_hash=root,
            speculate_rows=profile.speculative_max_batch,
            tiers=self._tiers(kv_disk),
            adapter_slots=profile.max_loras,
        )
        self.speculation = SpeculationStats()
        self.eos_ids = self._eos_ids()
        self.grammars = constrain.Grammars(loaded.tokenizer, self.vocab, self.eos_ids)
        self.sequences: dict[int, CoreSequence] = {}  # by the scheduler's sequence key
        self._opened: list[JobOpened] = []  # jobs added since the last step
        self._marking: dict[
            str, list[tuple[str, int]]
        ] = {}  # job -> its prefix marks, until its prompt is read
        self.text = TokenizerText.of(
            loaded.tokenizer
        )  # what the output processor decodes with, here or there
        self.output = OutputProcessor(self.text, node)  # the text side when `step()` runs it here

    def _tiers(self, kv_disk: tuple[Path, float] | None) -> KVTiers | None:
        """The KV tiers below the device pool (node_agent/engine/kv_tiers.py), where the profile or
        the node asks for one and the runner can copy blocks (node_agent/model/kv_host.py)."""
        copier = self.runner.tiers
        if copier is None or not (copier.host_blocks or kv_disk):
            return None
        disk = None
        if kv_disk:
            identity = dict(
                format=1,
                model=self.profile.id,
                source=self.profile.source,
                gguf_file=self.profile.gguf_file,
                quant=self.lm.quant,
                dtype=str(self.lm.dtype),
                block_size=self.profile.block_size,
                shape=list(copier.shape),
                adapter="",  # adapters (LoRA) are not served yet: their id goes here
            )
            disk = DiskTier(kv_disk[0], identity, int(kv_disk[1] * 1e9), copier.block_bytes)
        return KVTiers(copier.host_blocks, disk, copier.block_bytes)

    def _eos_ids(self) -> set[int]:
        ids = {self.lm.tokenizer.eos_token_id}
        configured = getattr(self.lm.model.generation_config, "eos_token_id", None)
        ids |= set(configured if isinstance(configured, list) else [configured])
        return {i for i in ids if i is not None}

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    @property
    def cache(self):
        return self.runner.cache

    @property
    def decoder(self):
        return self.runner.decoder

    @property
    def jobs(self) -> set[str]:
        """Jobs not yet over, on either side."""
        return set(self.scheduler.jobs) | {o.job for o in self._opened} | set(self.output.jobs)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def memory_bytes(self) -> int:
        """Weights, KV cache, sampling state and captured graphs: what this replica holds on its
        device. Plain numbers, so the event loop may read it without touching the device."""
        return self.runner.memory_bytes()

    def kv_stats(self) -> KVCacheStats:
        """The cache's blocks and the prefix cache's counters; plain numbers (read from the event loop)."""
        stats, tiers = self.scheduler.stats, self.scheduler.tiers
        below = {}
        if tiers is not None:  # TierStats' counters have KVCacheStats' names
            host, disk = tiers.host, tiers.disk
            below = dict(
                host_blocks_total=host.slots if host else 0,
                host_blocks_used=host.used if host else 0,
                disk_blocks=len(disk.files) if disk else 0,
                **dataclasses.asdict(tiers.stats),
            )
        return KVCacheStats(
            block_size=self.pool.block_size,
            blocks_total=self.pool.blocks,
            blocks_used=self.pool.used,
            blocks_cached=self.pool.cached,
            prefix_queries=stats.queries,
            prefix_hits=stats.hits,
            preemptions=stats.preemptions,
            **below,
        )

    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counters; plain numbers (read from the event loop)."""
        s = self.speculation
        return SpecDecodeStats(
            drafts=s.drafts, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens
        )

    def replica_facts(self) -> dict:
        """What a node's heartbeat says of this replica once loaded (shared/heartbeat.py ModelInfo's
        fields): its context, how its weights are held, which kernels its matmuls and its decode
        step run, its KV cache and its speculation."""
        decoder = self.runner.decoder
        step = f"decode step: {decoder.name}" if decoder is not None else ""
        return dict(
            max_model_len=self.max_len,
            quant=self.lm.quant,
            kernels="; ".join(part for part in (self.lm.kernels, step) if part),
            weight_mb=self.lm.weight_bytes >> 20,
            kv=self.kv_stats(),
            spec=self.spec_stats(),
        )

    def drop_model(self) -> None:
        """Drop every tensor (on unload), and a tensor-parallel model's other ranks."""
        self.fail_all()
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.close()
        self.runner.close()
        self.lm.model = None

    def load_adapter(self, name: str, folder: Path) -> None:
        """Read a LoRA adapter for requests that name it (`GenerationRequest.adapter`);
        AdapterLoadFailed saying why it cannot be (node_agent/model/lora_files.py)."""
        self.runner.load_adapter(name, folder)
        self.scheduler.adapters.forget(name)  # a slot holding an older copy is not reused

    def _hold_adapter(self, name: str, source: str) -> None:
        """A request's adapter, read from `source` when it is not held yet (or was read from
        another folder); AdapterLoadFailed (the request's alone) when it cannot be."""
        held = self.runner.adapters.get(name)
        if held is not None and (not source or str(Path(source)) == held.source):
            return
        if not source:
            raise AdapterLoadFailed(
                f"adapter {name!r} is not loaded on this replica of {self.profile.id}"
            )
        self.load_adapter(name, Path(source))

    def unload_adapter(self, name: str) -> None:
        """Refuse new requests for the adapter; its running sequences finish on its slot."""
        self.runner.unload_adapter(name)
        self.scheduler.adapters.forget(name)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    @property
    def processor(self):
        """A vision model's processor (its images into model inputs); None for a text model."""
        return self.lm.processor

    # ---- requests ----------------------------------------------------------------------------

    def add(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        submitted_ms: float,
        images: dict[str, np.ndarray] | None = None,
        share: Share = Share(),
    ) -> None:
        """Queue a job whose prompt is already tokenised and checked with `check_fits`; `images`: a
        vision model's processor inputs for the prompt's images (node_agent/serving/prompts.vision_prompt);
        `share`: whose share of the rows it takes, and whether it is a newcomer (Scheduler.add)."""
        params = request.sampling
        self._check_token_ids(prompt_ids, params)
        if request.adapter:
            self._hold_adapter(request.adapter, request.adapter_source)
        spans = self._image_spans(prompt_ids) if images else []
        pool_tokens = self.pool.blocks * self.pool.block_size
        if len(prompt_ids) + 1 > pool_tokens:
            raise ContextLengthExceeded(
                f"The prompt has {len(prompt_ids)} tokens; this model's KV cache holds {pool_tokens} tokens in all "
                f"({self.pool.blocks} blocks of {self.pool.block_size}). Please reduce the length of the prompt.",
                param="messages",
            )
        max_tokens = min(
            params.max_tokens or self.max_len - len(prompt_ids),
            self.max_len - len(prompt_ids),
            pool_tokens - len(prompt_ids),
        )
        seeds = [
            random.getrandbits(31) if params.seed is None else params.seed + i
            for i in range(params.n)
        ]
        matchers = [
            self.grammars.matcher(params.grammar) if params.grammar else None for _ in seeds
        ]
        method = params.speculative or self.profile.speculative
        keys = self.scheduler.add(
            request.job,
            prompt_ids,
            params,
            seeds,
            max_tokens,
            spans,
            images=bool(images),
            cache_salt=request.cache_salt,
            draft_tokens=self._draft_tokens(params, method),
            suffix=method == "suffix",
            adapter=request.adapter,
            share=share,
        )
        for key, matcher in zip(keys, matchers):
            self.sequences[key] = CoreSequence(request.job, params, max_tokens, matcher)
        self._opened.append(
            JobOpened(
                request.job,
                keys,
                len(prompt_ids),
                submitted_ms,
                list(params.stop),
                prompt_ids[0] if params.prompt_logprobs is not None else None,
            )
        )
        if images:
            self.runner.add_images(request.job, prompt_ids, images)
        elif request.prefix_marks and self.pool.caching:
            self._marking[request.job] = prefix_tokens(request.prefix_marks, len(prompt_ids))

    def _draft_tokens(self, params: SamplingParams, method: str) -> int:
        """How many tokens a step the request's sequences may draft by `method` (its own choice, else
        the catalogue's); none with penalties (each position would need the counts of the guesses before it)."""
        if (
            method == "off"
            or params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
        ):
            return 0
        return params.num_speculative_tokens or self.profile.num_speculative_tokens

    def _check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Token ids the request names must exist in this model's vocabulary."""
        for what, ids in (("prompt", prompt_ids), ("logit_bias", params.logit_bias)):
            bad = next((i for i in ids if not 0 <= i < self.vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{what} names token id {bad}, outside this model's vocabulary "
                    f"(0..{self.vocab - 1})",
                    param=what,
                )
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: give at least one token", param="prompt")

    def _image_spans(self, prompt_ids: list[int]) -> list[tuple[int, int]]:
        """The runs of image tokens a prefill chunk must not split (images that attend both ways)."""
        spans = vision.bidirectional_spans(self.lm.model.config, prompt_ids)
        longest = max((end - start for start, end in spans), default=0)
        if longest > self.profile.prefill_chunk_tokens:
            raise InvalidRequest(
                f"an image of {longest} tokens does not fit one prefill chunk "
                f"(prefill_chunk_tokens = {self.profile.prefill_chunk_tokens})"
            )
        return spans

    def cancel(self, job_id: str) -> bool:
        """Drop a job's sequences at once; no events are sent for it."""
        known = job_id in self.jobs
        self._end(self.scheduler.abort(job_id), job_id)
        self._opened = [o for o in self._opened if o.job != job_id]
        self._marking.pop(job_id, None)
        self.output.drop(job_id)
        return known

    def fail_all(self) -> list[str]:
        """Forget every job (after a device error); returns their ids."""
        failed = sorted(self.jobs)
        for job in failed:
            self.cancel(job)
        self.scheduler.clear()
        return failed

    def stop(self, keys: list[int]) -> None:
        """Sequences the output processor ended (a stop string, or its own work failed for the job)."""
        self._end(keys)

    def _end(self, keys: list[int], job: str | None = None) -> None:
        """These sequences are over: free them, and a job's runner state once none of its sequences is left."""
        self.scheduler.finish(set(keys))
        jobs = {self.sequences.pop(key).job for key in keys if key in self.sequences} | (
            {job} if job else set()
        )
        for gone in jobs - set(self.scheduler.jobs):
            self.runner.forget(gone)

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> StepEvents:
        """One engine step with its output processed here; returns (job id, wire events) for every job
        that has news."""
        events, stopped = self.output.process(self.core_step())
        self.stop(stopped)
        return events

    def core_step(self) -> StepOutput:
        """One engine step: schedule, run, end what the tokens end; text is the output processor's."""
        started_ms = time.time() * 1000
        plan = self.scheduler.schedule()
        out = StepOutput(0.0, started_ms, opened=self._opened)
        self._opened = []
        out.admitted = list(
            {s.job: self.scheduler.jobs[s.job].cached_tokens for s in plan.setups}.items()
        )
        matchers = [self.sequences[key].matcher for key in plan.samples]
        for row, matcher in zip(plan.decode, matchers):
            if matcher is not None and row.draft:
                row.draft = row.draft[: matcher.validate_tokens(row.draft)]
        result = self.runner.run(plan, self.grammars.bitmask(matchers, plan.drafts))
        if plan.saves:
            self.scheduler.tiers.write(plan.saves, result.saved)
        for job, exc in result.failed.items():
            self._fail(out, job, exc)
        out.scores = [
            PromptScoresOut(key, s.start, s.tokens, s.logprobs, s.tops)
            for key, s in result.prompt_scores.items()
        ]
        ended, kept = [], []
        for key, draft, sampled in zip(plan.samples, plan.drafts, result.sampled):
            self.speculation.count(len(draft), len(sampled) - 1)
            kept.append([s.token for s in sampled])
            if (seq := self.sequences.get(key)) is None:  # its job failed this step
                continue
            for i, s in enumerate(sampled):
                try:
                    finish = seq.advance(s.token, self.eos_ids)
                except Exception as exc:  # the grammar's host work: this job alone fails
                    self._fail(out, seq.job, exc)
                    break
                out.tokens.append(TokenOut(key, s.token, finish, s.logprob, s.top))
                if finish:
                    ended.append(key)
                    del kept[-1][i + 1 :]
                    break
        self.scheduler.update(plan.samples, kept, [len(draft) for draft in plan.drafts])
        self._mark_prefixes(out)
        self._end(ended)
        out.time_ms = time.time() * 1000
        return out

    def _mark_prefixes(self, out: StepOutput) -> None:
        """Anchor the prefix marks of the jobs whose prompt is now cached on the blocks that end them;
        report the marks newly held and those whose blocks were evicted (`StepOutput.held`, `dropped`)."""
        size = self.pool.block_size
        for job, marks in list(self._marking.items()):
            hashes = self.scheduler.prompt_hashes(job)
            if hashes is None:
                continue
            del self._marking[job]
            for mark, tokens in marks:
                block = tokens // size - 1
                if 0 <= block < len(hashes) and self.pool.mark(hashes[block], mark):
                    out.held.append((mark, tokens))
        out.dropped = self.pool.take_dropped()
        out.tiers = self.pool.take_retiered()

    def _fail(self, out: StepOutput, job: str, exc: Exception) -> None:
        """One job's own work raised: end its sequences; the output processor sends the error."""
        log.error(
            "job %s failed in its own work (%s: %s); the other rows go on",
            job,
            type(exc).__name__,
            exc,
        )
        error = (
            exc
            if isinstance(exc, CortexError)
            else GenerationFailed(f"{type(exc).__name__}: {exc}")
        )
        out.failed.append(JobFailed(job, error.code, error.message))
        self._end(self.scheduler.abort(job), job)


def prefix_tokens(marks: list[tuple[str, int]], prompt_tokens: int) -> list[tuple[str, int]]:
    """Each prefix mark (`shared.prefix_marks`: its name and the characters of the messages up to it)
    with the prompt tokens it spans: the last spans the prompt, the others their share of it by
    characters (the chat template's text around each message is about even)."""
    total = marks[-1][1] or 1
    return [
        (mark, prompt_tokens if i == len(marks) - 1 else prompt_tokens * chars // total)
        for i, (mark, chars) in enumerate(marks)
    ]


@dataclass(eq=False)
class CoreSequence:
    """A sequence's token-level state: its grammar and what ends it without text."""

    job: str
    params: SamplingParams
    max_tokens: int
    matcher: llguidance.LLMatcher | None = None
    tokens: int = 0

    def advance(self, token: int, eos_ids: set[int]) -> str | None:
        """Count the token and feed the grammar; the finish reason it gives, if it ends the sequence."""
        self.tokens += 1
        if self.matcher is not None and not constrain.advance(self.matcher, token):
            self.matcher = None
        if (token in eos_ids and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            return FinishReason.STOP
        return FinishReason.LENGTH if self.tokens >= self.max_tokens else None
