"""The model runner: turns a `StepPlan` into tensors, runs the forwards and samples, and returns a
`StepResult` of token ids and numbers. It owns everything on the device for one model: the paged
cache, the per-row sampling state and rope offsets, the block tables, the decoder, a prompt's image
embeddings. It never sees requests, text or Redis (vLLM v1's GPUModelRunner).

A step: apply the plan's row moves and new rows, copy the changed block tables in one go, run the
decode step for the decoding rows (node_agent/model/decoders.py) and one prefill forward for the
chunk group, then sample every row that has a next token (the decoding rows, then the chunks that
finished their prompt: rows 0..k-1) with one call and one device->host copy of the ids.

A step where some decoding row speculates (`DecodeRow.draft`) scores each such row's last token
and draft tokens as decode tokens of the packed forward, one after the other on the row's blocks
(each sees the positions up to its own: the decode kernel, one query a token), or, where the model
does not pack, in one padded forward over the decoding rows: the static decoder's verify step
(captured in CUDA graphs on a GPU), else eagerly.
Its rows keep the draft tokens the model accepts (node_agent/model/acceptance.py).
"""

import logging
from pathlib import Path

import llguidance.torch
import numpy as np
import torch

from node_agent.model import decoders, forward, lora_files, lora_layers
from node_agent.model.acceptance import NO_DRAFT, kept, verify
from node_agent.model.kv_cache import PackedChunk
from node_agent.model.kv_host import BlockCopier
from node_agent.model.loader import LoadedModel
from node_agent.model.model_calls import ModelCalls, paged_cache, weight_bytes
from node_agent.model.sampling import SlotSampling, sample, stages, token_logprobs
from node_agent.model.step import (
    DecodeRow,
    PrefillChunk,
    PromptScores,
    Sampled,
    StepPlan,
    StepResult,
)
from node_agent.model.vision import VisionPrompt, embed_prompt
from shared.catalog import ModelProfile
from shared.errors import AdapterLoadFailed

log = logging.getLogger(__name__)

Bitmask = tuple[
    torch.Tensor, list[int]
]  # llguidance's packed token bitmask, and the sampled rows it is for


class Runner:
    def __init__(
        self, loaded: LoadedModel, profile: ModelProfile, compile_cache: Path | None = None
    ):
        self.lm, self.profile = loaded, profile
        self.vocab = loaded.model.config.get_text_config().vocab_size
        self.cache = paged_cache(loaded, profile)
        self.calls = (
            loaded.group.calls(loaded.model, self.cache)
            if loaded.group
            else ModelCalls(loaded.model, self.cache)
        )  # every model call (to all ranks when sharded)
        self.sampling = SlotSampling(profile.slots, self.vocab, loaded.device)
        self.rope_offsets = torch.zeros(
            profile.slots, dtype=torch.long, device=loaded.device
        )  # moved with rows
        self.lora, self.lora_targets, self.adapters = None, {}, {}
        self.lora_refusal = self._install_lora(loaded, profile)
        self.decoder = decoders.make(
            profile.decode,
            loaded.model,
            self.cache,
            self.rope_offsets,
            profile.slots,
            self.calls.step,
            compile_cache,
        )
        self.tables = torch.zeros(
            profile.slots,
            self.cache.max_blocks,
            dtype=torch.long,
            pin_memory=loaded.device.type == "cuda",
        )
        self.images: dict[
            str, tuple[list[int], dict[str, np.ndarray]]
        ] = {}  # a job's prompt and processor inputs,
        # until its images are embedded
        self.vision: dict[str, VisionPrompt] = {}  # a job's prompt embeddings, while it runs
        self.tiers = self._tiers(profile, loaded)  # copies to and from the KV tiers, or None
        self.resident_bytes = weight_bytes(loaded.model) + self.cache.bytes + self.sampling.bytes
        log.info(
            "%s: %d KV blocks of %d tokens (%d MiB); decodes with %s steps",
            profile.id,
            self.cache.blocks,
            self.cache.block_size,
            self.cache.bytes >> 20,
            self.decoder.name,
        )

    def _tiers(self, profile: ModelProfile, loaded: LoadedModel) -> BlockCopier | None:
        """The KV tiers' copier, where a prefix can be kept below the device: attention layers
        only, on one device (not tensor-parallel), with prefix caching on."""
        if (
            not profile.prefix_caching
            or self.cache.has_linear_attention
            or loaded.tp_size > 1
            or not any(kind != "linear_attention" for kind in self.cache.layer_types)
        ):
            return None
        copier = BlockCopier(self.cache, 0)
        host_blocks = profile.kv_host_mb * (1 << 20) // copier.block_bytes
        return BlockCopier(self.cache, host_blocks) if host_blocks else copier

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def _install_lora(self, loaded: LoadedModel, profile: ModelProfile) -> str | None:
        """Wrap the targeted projections for `max_loras` adapter slots (before the decode step is
        compiled or captured); returns why adapters cannot be served, if so."""
        if not profile.max_loras:
            return "its catalogue entry sets no max_loras"
        if loaded.group:
            return "it is sharded over devices (tensor_parallel)"
        reason = lora_layers.why_not(loaded.model)
        if reason is None:
            self.lora, self.lora_targets = lora_layers.install(
                loaded.model, profile.max_loras, profile.slots, profile.max_lora_rank
            )
        return reason

    def load_adapter(self, name: str, folder: Path) -> lora_files.HostAdapter:
        """Read a PEFT LoRA adapter into host memory (into a device slot when a sequence needs it);
        AdapterLoadFailed saying why it cannot be served on this model."""
        if self.lora_refusal is not None:
            raise AdapterLoadFailed(
                f"adapter {name!r}: {self.profile.id} serves no adapters: {self.lora_refusal}"
            )
        adapter = lora_files.read(name, Path(folder), self.lora_targets, self.profile.max_lora_rank)
        self.unload_adapter(name)
        self.adapters[name] = adapter
        self.resident_bytes += adapter.bytes
        return adapter

    def unload_adapter(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            self.resident_bytes -= adapter.bytes

    def _fill_slot(self, slot: int, name: str) -> None:
        """Copy an adapter from host memory into device slot `slot` (every targeted projection:
        those it does not adapt are zeroed)."""
        weights = self.adapters[name].weights
        for path, (layer, part) in self.lora_targets.items():
            a, b = weights.get(path, (None, None))
            layer.place(part, slot, a, b)

    def _adapter_ids(self, ids: torch.Tensor | None = None) -> None:
        """The adapter slot of each token of the forward about to run (None: one token a row, rows 0..B-1)."""
        if self.lora is not None:
            self.lora.ids = self.lora.decode_ids if ids is None else ids

    def memory_bytes(self) -> int:
        return self.resident_bytes + self.decoder.graph_bytes

    def add_images(self, job: str, prompt_ids: list[int], images: dict[str, np.ndarray]) -> None:
        """A vision prompt's processor inputs (node_agent/serving/prompts.vision_prompt), embedded at
        its job's first chunk."""
        self.images[job] = prompt_ids, images

    def forget(self, job: str) -> None:
        self.images.pop(job, None)
        self.vision.pop(job, None)

    def close(self) -> None:
        self.calls.close()
        self.cache = self.sampling = self.decoder = self.calls = self.tiers = None
        self.lm.model = None

    @torch.inference_mode()
    def run(self, plan: StepPlan, bitmask: Bitmask | None = None) -> StepResult:
        result = StepResult()
        if self.tiers is not None:  # evicted blocks leave before their blocks are reused
            self.tiers.offload(plan.offloads)
            self.tiers.restore(plan.restores)
            self.tiers.load(plan.loads)
        self._place(plan)
        parts = []
        speculating = any(d.draft for d in plan.decode)
        if (plan.prefill or speculating) and self._packs():
            parts.append(self._packed(plan, result))
        else:
            if plan.decode:
                parts.append(self._verify(plan.decode) if speculating else self._decode(plan))
            if plan.prefill:
                last = self._prefill(plan.prefill, len(plan.decode), result)
                if last is not None:
                    parts.append(last)
        if plan.samples:
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            result.sampled = self._sample(logits, plan, bitmask)
        if plan.saves:
            result.saved = self.tiers.save([block for block, _ in plan.saves])
        return result

    def _place(self, plan: StepPlan) -> None:
        for src, dst in plan.moves:
            self.calls.move_row(src, dst)
            self.sampling.move(src, dst)
            self.rope_offsets[dst] = self.rope_offsets[src]
            if self.lora is not None:
                self.lora.row_slots[dst] = self.lora.row_slots[src]
        for slot, name in plan.adapter_loads.items():
            self._fill_slot(slot, name)
        for setup in plan.setups:
            self.sampling.assign(
                setup.row, setup.params, setup.prompt_ids, setup.seed, setup.output_ids
            )
            prompt = self.vision.get(setup.job)
            self.rope_offsets[setup.row] = prompt.rope_delta if prompt else 0
            if self.lora is not None:
                self.lora.row_slots[setup.row] = setup.adapter_slot
        if plan.tables:
            for row, blocks in plan.tables.items():
                self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
                self.tables[row, len(blocks) :] = 0
            self.calls.set_tables(self.tables[: plan.rows])

    def _decode(self, plan: StepPlan) -> torch.Tensor:
        tokens, positions = [d.token for d in plan.decode], [d.position for d in plan.decode]
        self._adapter_ids()
        try:
            return self.decoder(tokens, positions)
        except decoders.CaptureFailed as exc:
            log.warning(
                "%s: the decode step cannot be captured (%s); decoding eagerly from now on",
                self.profile.id,
                exc,
            )
            self.decoder = decoders.EagerDecoder(self.lm.model, self.cache, self.rope_offsets)
            return self.decoder(tokens, positions)

    def _packs(self) -> bool:
        """Whether this step's prefill chunks and decode rows run as one packed forward: text prompts
        of a model that can (node_agent/model/model_calls.py), on a text-only model (rotary offsets and
        image embeddings are per row). Chunks with no row decoding pack too: the padded forward would
        compute every chunk at the widest one's width, through masks over whole rows (a step that
        ends one 2,600-token prompt and starts the next took 3.2 s padded, 0.95 s packed)."""
        return self.calls.packs and self.lm.processor is None

    def _packed(self, plan: StepPlan, result: StepResult) -> torch.Tensor:
        """The decode rows and the prefill chunks in one forward (each Linear layer reads its weights
        once a step, as vLLM's flattened batch): first each decoding row's last token and draft
        tokens, then the prefill chunks; returns the logits of every position that samples, in
        `plan.samples` order (a speculating row's all)."""
        rows = [d.row for d in plan.decode for _ in range(d.width)]
        offset, packed = len(rows), []
        for i, chunk in enumerate(plan.prefill):
            packed.append(
                PackedChunk(
                    row=len(plan.decode) + i,
                    start=chunk.start,
                    length=len(chunk.tokens),
                    offset=offset,
                )
            )
            offset += len(chunk.tokens)
        tokens = [t for d in plan.decode for t in [d.token, *d.draft]] + [
            t for c in plan.prefill for t in c.tokens
        ]
        positions = [d.position + j for d in plan.decode for j in range(d.width)] + [
            p for c in packed for p in range(c.start, c.start + c.length)
        ]
        device = self.lm.device
        if self.lora is not None:
            token_rows = rows + [c.row for c in packed for _ in range(c.length)]
            self._adapter_ids(self.lora.row_slots[torch.tensor(token_rows, device=device)][None])
        hidden = self.calls.packed_forward(
            torch.tensor(tokens, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(rows, dtype=torch.long, device=device),
            packed,
        )
        for chunk, place in zip(plan.prefill, packed):
            if chunk.score_top is not None and chunk.following:
                result.prompt_scores[chunk.key] = self._score(
                    chunk, hidden[place.offset : place.offset + len(chunk.following)]
                )
        sampled = list(range(len(rows))) + [
            p.offset + p.length - 1 for chunk, p in zip(plan.prefill, packed) if chunk.samples
        ]
        return self.calls.logits(hidden[torch.tensor(sampled, dtype=torch.long, device=device)])

    def _verify(self, rows: list[DecodeRow]) -> torch.Tensor:
        """The decoding rows' last tokens and draft tokens in one forward (rows 0.., right-padded to
        the widest); returns the logits of all their positions, row after row."""
        index = [(i, j) for i, d in enumerate(rows) for j in range(d.width)]
        picked = [i for i, _ in index], [j for _, j in index]
        self._adapter_ids()
        if self.decoder.verifies:
            try:
                return self.decoder.verify(
                    [[d.token, *d.draft] for d in rows], [d.position for d in rows]
                )[picked]
            except decoders.CaptureFailed as exc:
                log.warning(
                    "%s: the verify step cannot be captured (%s); verifying eagerly from now on",
                    self.profile.id,
                    exc,
                )
                self.decoder.verifies = False
        input_ids, positions, write_pos, kv_len = self._padded(
            [([d.token, *d.draft], d.position) for d in rows]
        )
        rope = positions + self.rope_offsets[: len(rows), None]
        hidden = self.calls.forward(
            slice(0, len(rows)), input_ids, positions, write_pos, kv_len, rope_positions=rope
        )
        return self.calls.logits(hidden[picked])

    def _padded(
        self, rows: list[tuple[list[int], int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A forward's inputs for rows of (tokens, first position), right-padded to the widest: token
        ids, positions and write positions ([rows, width], on the device; padding writes the scratch
        position), and the positions read."""
        inputs = torch.empty(3, len(rows), max(len(tokens) for tokens, _ in rows), dtype=torch.long)
        forward.padded_inputs(rows, inputs, self.cache.scratch_position, self.max_len)
        input_ids, positions, write_pos = inputs.to(self.lm.device)
        return (
            input_ids,
            positions,
            write_pos,
            min(max(start + len(tokens) for tokens, start in rows), self.max_len),
        )

    def _prefill(
        self, chunks: list[PrefillChunk], start: int, result: StepResult
    ) -> torch.Tensor | None:
        """One forward over the chunk group (rows start.., right-padded to the widest chunk);
        returns the logits of the chunks that sample."""
        device = self.lm.device
        input_ids, positions, write_pos, kv_len = self._padded(
            [(c.tokens, c.start) for c in chunks]
        )
        embeds, rope, sees_until = self._vision_inputs(chunks, input_ids, positions, start, result)
        if self.lora is not None:
            self._adapter_ids(self.lora.row_slots[start : start + len(chunks), None])
        hidden = self.calls.forward(
            slice(start, start + len(chunks)),
            input_ids,
            positions,
            write_pos,
            kv_len,
            inputs_embeds=embeds,
            rope_positions=rope,
            sees_until=sees_until,
        )
        for i, chunk in enumerate(chunks):
            if chunk.score_top is not None and chunk.following:
                result.prompt_scores[chunk.key] = self._score(
                    chunk, hidden[i, : len(chunk.following)]
                )
        done = [i for i, chunk in enumerate(chunks) if chunk.samples]  # a prefix of the group
        if not done:
            return None
        last = hidden[
            torch.tensor(done, device=device),
            torch.tensor([len(chunks[i].tokens) - 1 for i in done], device=device),
        ]
        return self.calls.logits(last)

    def _vision_inputs(
        self,
        chunks: list[PrefillChunk],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        result: StepResult,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """A chunk group's embeddings, rope positions and last positions seen, where some row reads
        a prompt with images (its chunk's slice of each; the other rows embed their tokens and see
        causally); Nones otherwise. A job's images are embedded at its first chunk."""
        rows = []
        for i, chunk in enumerate(chunks):
            prompt = self._embedded(chunk, result)
            if prompt is not None:
                self.rope_offsets[start + i] = prompt.rope_delta
                # a preempted sequence reads its output again after the prompt: plain tokens there
                in_prompt = max(0, min(len(chunk.tokens), prompt.embeds.shape[0] - chunk.start))
                rows.append((i, prompt, chunk.start, in_prompt))
        if not rows:
            return None, None, None
        embeds = self.lm.model.get_input_embeddings()(input_ids)
        for i, prompt, begin, n in rows:
            embeds[i, :n] = prompt.embeds[begin : begin + n]
        rope = sees_until = None
        if any(prompt.rope is not None for _, prompt, _, _ in rows):
            rope = positions[None].repeat(3, 1, 1)
            for i, prompt, begin, n in rows:
                if prompt.rope is not None:
                    rope[:, i, :n] = prompt.rope[:, begin : begin + n]
                    rope[:, i, n:] += prompt.rope_delta
        if any(prompt.sees_until is not None for _, prompt, _, _ in rows):
            sees_until = positions.clone()
            for i, prompt, begin, n in rows:
                if prompt.sees_until is not None:
                    sees_until[i, :n] = prompt.sees_until[begin : begin + n]
        return embeds, rope, sees_until

    def _embedded(self, chunk: PrefillChunk, result: StepResult) -> VisionPrompt | None:
        """The chunk's job's prompt embeddings (running the vision tower once per job); None for a
        text prompt, or when its images failed (the job fails; the chunk's writes go unread)."""
        if chunk.job in self.vision or chunk.job not in self.images:
            return self.vision.get(chunk.job)
        try:
            self.vision[chunk.job] = embed_prompt(
                self.lm.model, *self.images.pop(chunk.job), self.lm.device
            )
        except Exception as exc:
            log.exception("job %s: its images could not be embedded", chunk.job)
            result.failed[chunk.job] = exc
            return None
        return self.vision[chunk.job]

    def _score(self, chunk: PrefillChunk, hidden: torch.Tensor) -> PromptScores:
        """Prompt logprobs for this chunk: each position scores the prompt token that follows it."""
        logits = self.calls.logits(hidden)
        chosen, tops = token_logprobs(
            logits, torch.tensor(chunk.following, device=logits.device), chunk.score_top
        )
        return PromptScores(chunk.start, chunk.following, chosen, tops)

    def _sample(
        self, logits: torch.Tensor, plan: StepPlan, bitmask: Bitmask | None
    ) -> list[list[Sampled]]:
        """Each sampled row's new tokens from `logits` (a row per position that samples: a
        speculating row's every position), with one device->host copy."""
        params, drafts, device = plan.sample_params, plan.drafts, logits.device
        use = stages(params)
        raw = logits
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask(logits, *bitmask)
        widths = [1 + len(draft) for draft in drafts]
        rows = torch.arange(len(params), device=device).repeat_interleave(
            torch.tensor(widths, device=device)
        )
        positions = [p + j for p, width in zip(plan.sample_positions, widths) for j in range(width)]
        if len(positions) == len(params):  # no draft: a plain draw
            noise_at = torch.tensor(positions, device=device) if use.sampling else None
            tokens = sample(logits, self.sampling, slice(0, len(params)), noise_at, use)
            ids, runs = tokens.tolist(), [0] * len(params)  # the step's one device->host copy
        else:
            guesses = [t for draft in drafts for t in [*draft, NO_DRAFT]]
            accepted, tokens = verify(
                logits,
                self.sampling,
                rows,
                torch.tensor(positions, device=device),
                torch.tensor(guesses, device=device),
                use,
            )
            ids, flags = torch.stack(
                [tokens, accepted.long()]
            ).tolist()  # the step's one device->host copy
            runs = kept([bool(f) for f in flags], widths)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        out = [
            [Sampled(ids[start + j]) for j in range(run + 1)] for start, run in zip(starts, runs)
        ]
        if use.penalties:
            place = torch.tensor(
                [start + j for start, run in zip(starts, runs) for j in range(run + 1)],
                device=device,
            )
            self.sampling.record(rows[place], tokens[place])
        asked = [i for i, p in enumerate(params) if p.logprobs]
        if asked:
            place = torch.tensor(
                [starts[i] + j for i in asked for j in range(runs[i] + 1)], device=device
            )
            chosen, tops = token_logprobs(
                raw[place], tokens[place], max(params[i].top_logprobs for i in asked)
            )
            entries = iter(zip(chosen, tops))
            for i in asked:
                for sampled in out[i]:
                    sampled.logprob, top = next(entries)
                    sampled.top = top[: params[i].top_logprobs]
        return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Forbid, in place, every token a row's grammar does not allow (rows without one untouched)."""
    index = torch.tensor(rows, device=logits.device)
    masked = logits[index]
    llguidance.torch.apply_token_bitmask_inplace(masked, bitmask.to(logits.device))
    logits[index] = masked
