"""The scheduler: which sequences run, which KV blocks they hold, and what each step computes. No
tensors and no text: it turns its sequences into a `StepPlan` (node_agent/model/step.py) for the
runner, and takes back the tokens sampled and the sequences that finished (vLLM v1's Scheduler).

Each `schedule()`:
1. **Decode blocks.** Every decoding sequence gets a block when its next token starts one. With
   none left, the newest running sequence is preempted: its blocks are released (their full blocks
   stay cached) and it goes back to the front of the queue, to be recomputed from its tokens
   (vLLM's recompute mode), never failed.
2. **Admission**, first come first served, while a row is free and the blocks of its prompt (less
   its longest cached prefix, plus one token) are: it holds the cached blocks and reads only the
   rest. The sequences of one n > 1 job after the first wait until the first has read the prompt,
   then find its blocks cached and share them.
3. **Prefill**: the next chunk of the waiting prompts, several sequences together, up to
   `prefill_chunk_tokens` (a model with linear-attention layers groups only chunks of equal width:
   right padding would be folded into its state; a bidirectional image is never split).
4. **Decode**: one token for every decoding sequence, and the draft tokens of those that
   speculate (node_agent/engine/speculation.py) while at most `speculate_rows` sequences decode:
   they count in the step's token budget (what prefill may take) and get blocks while some are
   free (never by preempting); the blocks beyond a sequence's accepted tokens go back after it.
Full blocks are registered in the pool by their hash chain as soon as they are planned, so the next
step's admissions can reuse them.

With KV tiers (node_agent/engine/kv_tiers.py), a prompt's cached prefix may continue below the
device: admission gives those blocks device blocks and plans their copies back (within the step's
restore budget; a sequence whose copies do not fit waits for the next step), and the blocks the pool
evicts are offered to the tiers, their copies planned in the same step, before any forward reuses
them. Newly computed blocks are listed for the disk tier.
"""

import hashlib
import itertools
from collections import deque
from dataclasses import dataclass, field

from node_agent.engine.adapter_slots import AdapterSlots
from node_agent.engine.blocks import BlockPool, chain_hashes
from node_agent.engine.kv_tiers import RESTORE_RATIO, Below, KVTiers
from node_agent.engine.speculation import Drafter, RecentOutputs
from node_agent.model.step import DecodeRow, PrefillChunk, RowSetup, StepPlan
from shared.wire import SamplingParams


@dataclass(frozen=True)
class Share:
    """Whose share of the rows a job takes (its caller: an API key's name, `admin`, `anonymous`)
    and whether it came as a newcomer: its caller had no job on the replica while others' jobs
    waited (node_agent/serving/job_reader.py), so it may take a row from the largest share."""

    tenant: str = ""
    newcomer: bool = False


@dataclass(eq=False)
class Sequence:
    key: int
    job: "JobEntry"
    index: int
    tokens: list[int]  # the prompt, then the tokens sampled so far
    prompt_len: int
    params: SamplingParams
    seed: int
    max_tokens: int  # the most output tokens it may have
    drafter: Drafter | None = None  # its speculation, when it speculates
    computed: int = 0  # tokens whose keys and values are in its blocks
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(
        default_factory=list
    )  # of the full blocks of its tokens, as far as computed
    registered: int = 0  # of its blocks offered to the pool's prefix cache
    decoding: bool = False  # read all it had to read; one token a step from now on
    done: bool = False
    admitted: int = 0  # admission order (the newest is preempted first)
    synced: tuple[int, int] = (-1, 0)  # (row, blocks) the runner's block table last had
    slot: int = 0  # its adapter's device slot while it holds a row (0: the base)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def scores_prompt(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.output_ids


@dataclass(eq=False)
class JobEntry:
    id: str
    sequences: list[Sequence] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(
        default_factory=list
    )  # image token runs a chunk never splits
    cacheable: bool = True  # its blocks may be shared (no images, a model without linear attention)
    root_hash: bytes = (
        b""  # what its blocks' hash chain starts from: the model's, salted by its cache salt
    )
    cached_tokens: int = 0  # of its prompt, the tokens its first sequence found cached
    adapter: str = ""  # the LoRA adapter it runs with ("": the base)
    # whose share of the rows it takes; a newcomer may take a row from the largest (Scheduler.add)
    share: Share = Share()


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up in the prefix cache (at a first admission)
    hits: int = 0  # of those, found cached (in any tier)
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_seqs: int,
        chunk_tokens: int,
        linear_attention: bool,
        root_hash: bytes,
        speculate_rows: int = 0,
        tiers: KVTiers | None = None,
        adapter_slots: int = 0,
    ):
        self.pool, self.max_seqs, self.chunk_tokens = pool, max_seqs, chunk_tokens
        self.tiers = tiers if pool.caching and not linear_attention else None
        if self.tiers is not None:
            pool.spill, pool.below = self.tiers.spill, self.tiers.where
            self.tiers.moved = pool.moved
        self.speculate_rows = speculate_rows
        self.recent = (
            RecentOutputs()
        )  # the outputs "suffix" speculation looks up, of the sequences that use it
        self.linear_attention, self.root_hash = linear_attention, root_hash
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # rows[:n_decoding] decode; the rest read their prompt
        self.n_decoding = 0
        self.jobs: dict[str, JobEntry] = {}
        self.stats = PrefixStats()
        self._keys = itertools.count()
        self._admissions = itertools.count(1)
        self._moves: list[tuple[int, int]] = []  # row moves not yet handed to the runner
        self.adapters = AdapterSlots(adapter_slots)
        self._loads: dict[int, str] = {}  # adapter slots to load, not yet handed to the runner

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    # ---- requests ----------------------------------------------------------------------------

    def add(
        self,
        job: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seeds: list[int],
        max_tokens: int,
        spans: list[tuple[int, int]] = (),
        images: bool = False,
        cache_salt: str = "",
        draft_tokens: int = 0,
        suffix: bool = False,
        adapter: str = "",
        share: Share = Share(),
    ) -> list[int]:
        """Queue a job's sequences (one per seed), each speculating up to `draft_tokens` tokens a
        step (0: not at all; never with linear attention, whose state cannot take a guess back),
        with `suffix` from the recent outputs of unsalted jobs too (a salted job's outputs, like its
        blocks, are never another's to guess from); returns their keys. Its blocks are shared only
        with jobs of the same `cache_salt` (`GenerationRequest.cache_salt`) and the same LoRA
        `adapter` (a block computed under one adapter is never another's, nor the base's). A newcomer
        (`share`) waits ahead of the other jobs and, with every row taken, preempts the newest
        sequence of the caller holding the most rows, if that caller holds more than one (`_displace`)."""
        salt = cache_salt.encode() + (b"\0adapter:" + adapter.encode() if adapter else b"")
        root = (
            hashlib.blake2b(self.root_hash + salt, digest_size=16).digest()
            if salt
            else self.root_hash
        )
        entry = JobEntry(
            job,
            spans=list(spans),
            cacheable=not images and not self.linear_attention,
            root_hash=root,
            adapter=adapter,
            share=share,
        )
        recent = self.recent if suffix and not cache_salt else None
        for index, seed in enumerate(seeds):
            drafter = (
                Drafter.of(prompt_ids, draft_tokens, recent)
                if draft_tokens and not self.linear_attention
                else None
            )
            entry.sequences.append(
                Sequence(
                    next(self._keys),
                    entry,
                    index,
                    list(prompt_ids),
                    len(prompt_ids),
                    params,
                    seed,
                    max_tokens,
                    drafter,
                )
            )
        self.jobs[job] = entry
        if share.newcomer:  # after the newcomers already waiting, ahead of everyone else
            ahead = next(
                (i for i, s in enumerate(self.waiting) if not s.job.share.newcomer),
                len(self.waiting),
            )
            for offset, seq in enumerate(entry.sequences):
                self.waiting.insert(ahead + offset, seq)
        else:
            self.waiting.extend(entry.sequences)
        return [s.key for s in entry.sequences]

    def finish(self, keys: set[int]) -> None:
        """These sequences are done (or their job failed or was cancelled): free their rows and blocks."""
        if not keys:
            return
        for job in list(self.jobs.values()):
            for seq in job.sequences:
                if seq.key in keys and not seq.done:
                    seq.done = True
                    if seq.drafter is not None and seq.drafter.recent is not None:
                        seq.drafter.recent.add(seq.output_ids)
                    if seq in self.waiting:
                        self.waiting.remove(seq)
                    elif seq in self.rows:
                        self._release(seq)
            if all(s.done for s in job.sequences):
                del self.jobs[job.id]
        self._pack()

    def abort(self, job: str) -> list[int]:
        """Drop a job's sequences; returns their keys."""
        entry = self.jobs.get(job)
        keys = {s.key for s in entry.sequences} if entry else set()
        self.finish(keys)
        return sorted(keys)

    def prompt_hashes(self, job: str) -> list[bytes] | None:
        """The hash chain of a job's prompt blocks once its first sequence has read its prompt (they are
        cached then); None while it is still reading, [] for a job that is gone or not cacheable."""
        entry = self.jobs.get(job)
        if entry is None or not entry.cacheable or not self.pool.caching:
            return []
        first = entry.sequences[0]
        return first.hashes if first.decoding else None

    def clear(self) -> None:
        """Forget every sequence (after a device fault: the cache's contents are not to be trusted)."""
        self.waiting.clear()
        self.rows.clear()
        self.jobs.clear()
        self.n_decoding = 0
        self._moves.clear()
        self.pool.reset()
        if self.tiers is not None:
            self.tiers.reset()
        self.adapters = AdapterSlots(self.adapters.slots)
        self._loads.clear()

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        if seq.slot:
            self.adapters.release(seq.slot)
        seq.blocks, seq.registered, seq.synced, seq.slot = [], 0, (-1, 0), 0
        self.rows.remove(seq)

    def _pack(self) -> None:
        """Rows of the sequences that left are filled by those after them, decoding rows first."""
        decoding = [s for s in self.rows if s.decoding]
        reading = [s for s in self.rows if not s.decoding]
        self.rows, self.n_decoding = decoding + reading, len(decoding)
        for dst, seq in enumerate(self.rows):
            if seq.synced[0] not in (dst, -1):
                self._moves.append((seq.synced[0], dst))
                seq.synced = (dst, -1)  # its block table goes to its new row

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        if self.tiers is not None:
            self.tiers.begin()
        plan = StepPlan()
        self._grow_decoding()
        plan.setups = self._admit(plan)
        drafts = self._drafts()
        restored = self.tiers.restored // RESTORE_RATIO if self.tiers is not None else 0
        plan.prefill = self._chunks(self.chunk_tokens - sum(map(len, drafts)) - restored)
        plan.decode = [
            DecodeRow(row, s.tokens[-1], s.computed, draft)
            for row, (s, draft) in enumerate(zip(self.rows[: self.n_decoding], drafts))
        ]
        for seq in self.rows[: self.n_decoding]:
            seq.computed += 1
        plan.saves = self._register(self.rows)
        if self.tiers is not None:
            plan.offloads = self.tiers.offloads
        plan.moves, self._moves = self._moves, []
        plan.adapter_loads, self._loads = self._loads, {}
        plan.tables = self._tables()
        plan.rows = len(self.rows)
        sampled = self.rows[: self.n_decoding] + [
            self.rows[c.row] for c in plan.prefill if c.samples
        ]
        plan.samples = [s.key for s in sampled]
        plan.sample_params = [s.params for s in sampled]
        plan.sample_positions = [len(s.tokens) - 1 for s in sampled]
        return plan

    def update(self, keys: list[int], tokens: list[list[int]], drafted: list[int]) -> None:
        """The new tokens of these sequences (a plan's `samples`): the draft tokens accepted of the
        `drafted` ones verified, then the model's next. Those that finished their prompt decode
        from now on; the blocks a sequence took for draft tokens it did not keep go back."""
        by_key = {s.key: s for s in self.rows}
        for key, new, verified in zip(keys, tokens, drafted):
            seq = by_key.get(key)
            if seq is None:
                continue
            if seq.decoding:  # the accepted draft tokens' keys and values stay
                seq.computed += len(new) - 1
            seq.tokens += new
            seq.decoding = True
            if seq.drafter is not None:
                seq.drafter.accepted(verified, new)
            self._trim(seq)
        self._pack()

    def _drafts(self) -> list[list[int]]:
        """Each decoding sequence's draft tokens this step (none above `speculate_rows` sequences),
        within the token budget, its output limit and the blocks it holds or that are free."""
        decoding = self.rows[: self.n_decoding]
        if len(decoding) > self.speculate_rows:
            return [[] for _ in decoding]
        budget, drafts = self.chunk_tokens // 2, []
        for seq in decoding:
            room = min(budget, seq.max_tokens - len(seq.output_ids) - 1)
            draft = seq.drafter.propose(room) if seq.drafter is not None else []
            held = (
                len(seq.blocks) * self.pool.block_size - seq.computed - 1
            )  # positions after its last token
            missing = self.pool.blocks_for(len(draft) - held) if len(draft) > held else 0
            if missing > self.pool.free:
                draft = draft[: held + self.pool.free * self.pool.block_size]
                missing = self.pool.free
            if missing:
                seq.blocks += self.pool.allocate(missing)
            budget -= len(draft)
            drafts.append(draft)
        return drafts

    def _trim(self, seq: Sequence) -> None:
        """Give back the blocks beyond the one its next token is written to."""
        keep = seq.computed // self.pool.block_size + 1
        if len(seq.blocks) > keep:
            self.pool.release(seq.blocks[keep:])
            seq.blocks = seq.blocks[:keep]
            seq.synced = (seq.synced[0], -1)  # its table changes under a length it had before

    def _grow_decoding(self) -> None:
        """A block for every decoding sequence whose next token starts one, preempting the newest
        sequences while none is free."""
        for seq in list(self.rows[: self.n_decoding]):
            if seq not in self.rows or seq.computed < len(seq.blocks) * self.pool.block_size:
                continue
            while self.pool.free == 0:
                victim = max(self.rows, key=lambda s: s.admitted)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.blocks += self.pool.allocate(1)
        self._pack()

    def _preempt(self, seq: Sequence, at: int = 0) -> None:
        """Give back a running sequence's blocks; it waits at place `at` of the queue (the head by
        default) and is recomputed from its tokens later."""
        self._release(seq)
        seq.computed, seq.decoding = 0, False
        self.waiting.insert(at, seq)
        self.stats.preemptions += 1

    def _displace(self) -> bool:
        """Make a row for the newcomer at the head of the queue: preempt the newest sequence of the
        caller holding the most rows (more than one; never another newcomer's), which then waits
        right after it. False when no caller holds more than its one row."""
        held: dict[str, list[Sequence]] = {}
        for seq in self.rows:
            if not seq.job.share.newcomer:
                held.setdefault(seq.job.share.tenant, []).append(seq)
        largest = max(held.values(), key=len, default=[])
        if len(largest) < 2:
            return False
        self._preempt(max(largest, key=lambda s: s.admitted), at=1)
        self._pack()
        return True

    def _admit(self, plan: StepPlan) -> list[RowSetup]:
        setups = []
        while self.waiting and (
            len(self.rows) < self.max_seqs
            or (self.waiting[0].job.share.newcomer and self._displace())
        ):
            seq = self.waiting[0]
            first = seq.job.sequences[0]
            if (
                seq is not first
                and seq.job.cacheable
                and self.pool.caching
                and not first.decoding
                and first.computed < first.prompt_len
            ):
                break  # an n > 1 job's other sequences share the first one's prompt blocks once it has read them
            cached, below = self._cached_prefix(seq)
            if below and not self.tiers.within_budget(
                below, self.pool.block_size, self.chunk_tokens
            ):
                break  # its copies wait for the next step's budget
            holding = sum(self.pool.refs[b] == 0 for b in cached)
            need = self.pool.blocks_for(len(seq.tokens) + 1) - len(cached)
            if self.pool.free - holding < need:
                break
            if seq.job.adapter:
                taken = self.adapters.acquire(seq.job.adapter)
                if taken is None:
                    break  # every adapter slot is in use by running sequences
                seq.slot = taken[0]
                if taken[1]:
                    self._loads[seq.slot] = seq.job.adapter
            self.waiting.popleft()
            self.pool.hold(cached)
            fresh = self.pool.allocate(need)
            below = self._restore(plan, below, fresh) if below else []
            seq.blocks = cached + fresh
            found = len(cached) + len(below)
            seq.registered, seq.computed = found, found * self.pool.block_size
            self._count(seq, found, below)
            seq.admitted = next(self._admissions)
            seq.synced = (len(self.rows), 0)
            setups.append(
                RowSetup(
                    len(self.rows),
                    seq.job.id,
                    seq.params,
                    seq.tokens[: seq.prompt_len],
                    seq.output_ids,
                    seq.seed,
                    seq.slot,
                )
            )
            self.rows.append(seq)
        return setups

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[Below]]:
        """The device blocks of the sequence's longest cached prefix, and where it continues below
        the device, leaving at least one token to read (its logits give the next token)."""
        if not (self.pool.caching and seq.job.cacheable) or seq.scores_prompt:
            return [], []
        usable = (len(seq.tokens) - 1) // self.pool.block_size
        self._hash(seq, usable)
        cached = self.pool.match(seq.hashes[:usable])
        below = self.tiers.match(seq.hashes[len(cached) : usable]) if self.tiers else []
        return cached, below

    def _restore(self, plan: StepPlan, below: list[Below], blocks: list[int]) -> list[Below]:
        """Plan the copies of the prefix blocks found below into the first of `blocks` (as far as
        they can be had), which then hold their hashes; returns those copied."""
        below = self.tiers.read(below)
        restores, loads = self.tiers.restore(below, blocks, self.pool.block_size)
        plan.restores += restores
        plan.loads += loads
        for found, block in zip(below, blocks):
            self.pool.register(block, found.block_hash)
        return below

    def _count(self, seq: Sequence, found: int, below: list[Below]) -> None:
        """A first admission's prompt tokens looked up and found cached, `below` the device among
        them (a resumed sequence's prompt was counted once)."""
        if not seq.output_ids:
            if below:
                self.tiers.count(below, self.pool.block_size)
            self.stats.queries += seq.prompt_len
            self.stats.hits += found * self.pool.block_size
            if seq.index == 0:
                seq.job.cached_tokens = found * self.pool.block_size

    def _chunks(self, budget: int) -> list[PrefillChunk]:
        chunks = []
        for row in range(self.n_decoding, len(self.rows)):
            seq = self.rows[row]
            if budget <= 0:
                break
            n = self._chunk_length(seq, min(len(seq.tokens) - seq.computed, budget))
            if chunks and self.linear_attention and n != len(chunks[0].tokens):
                break
            end = seq.computed + n
            chunks.append(
                PrefillChunk(
                    key=seq.key,
                    row=row,
                    job=seq.job.id,
                    tokens=seq.tokens[seq.computed : end],
                    start=seq.computed,
                    samples=end == len(seq.tokens),
                    score_top=seq.params.prompt_logprobs if seq.scores_prompt else None,
                    following=seq.tokens[seq.computed + 1 : min(end + 1, seq.prompt_len)]
                    if seq.scores_prompt
                    else [],
                )
            )
            seq.computed = end
            budget -= n
            if end < len(seq.tokens):
                break  # the budget ran out inside this prompt: the sequences that sample are a prefix
        return chunks

    def _chunk_length(self, seq: Sequence, length: int) -> int:
        """At most `length` tokens from where the sequence is, ending outside every image that
        attends both ways (unless one starting there is longer)."""
        start, end = seq.computed, seq.computed + length
        for span_start, span_end in seq.job.spans:
            if span_start < end < span_end:
                return span_start - start if span_start > start else span_end - start
        return length

    def _register(self, seqs: list[Sequence]) -> list[tuple[int, bytes]]:
        """Offer the full blocks planned so far to later sequences (their keys and values are
        written by the forward this plan runs, before any later plan reads them); returns those
        the disk tier is to keep, with their hashes."""
        saves: list[tuple[int, bytes]] = []
        if not self.pool.caching:
            return saves
        size = self.pool.block_size
        for seq in seqs:
            full = seq.computed // size
            if not seq.job.cacheable or seq.registered >= full:
                continue
            self._hash(seq, full)
            for i in range(seq.registered, full):
                block, block_hash = seq.blocks[i], seq.hashes[i]
                if (
                    self.pool.register(block, block_hash)
                    and self.tiers is not None
                    and self.tiers.keeps_on_disk(block_hash)
                ):
                    saves.append((block, block_hash))
            seq.registered = full
        return saves

    def _hash(self, seq: Sequence, blocks: int) -> None:
        """Extend the sequence's hash chain over its first `blocks` full blocks."""
        if len(seq.hashes) < blocks:
            size = self.pool.block_size
            seq.hashes += chain_hashes(
                seq.tokens[: blocks * size],
                size,
                seq.hashes[-1] if seq.hashes else seq.job.root_hash,
                start=len(seq.hashes),
            )

    def _tables(self) -> dict[int, list[int]]:
        """The block tables of the rows whose sequence or blocks changed since the runner last had them."""
        tables = {}
        for row, seq in enumerate(self.rows):
            if seq.synced != (row, len(seq.blocks)):
                tables[row] = seq.blocks
                seq.synced = (row, len(seq.blocks))
        return tables
