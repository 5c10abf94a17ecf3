"""The engine of an embedding or rerank model, on its device thread: jobs' inputs wait in one
queue, and each `core_step()` runs one forward pass over as many of them as fit
`pooling_batch_tokens` (padding included), so inputs of many jobs share a pass and a long job
shares the device with the other models' steps between its passes.

On a CPU, an embedding model that allows it (node_agent/model/packed_pooling.py) runs its passes
packed: the waiting inputs in arrival order, up to the budget, one after another in one row, no
padding at all. While another model's engine shares the device (`shares_device`), a pass takes
only the tokens that fit `pooling_pass_ms` at the speed the last pass ran, so that engine's steps
(a newcomer's first token) wait no longer than that between passes. Otherwise a step takes the
waiting inputs in arrival order up to that budget, sorts them by length and runs the longest ones that fit, padded to the longest: rows of a pass
differ little in length, so little of it is padding. A job is done when its last input is pooled;
its result leaves as a `Pooled` record."""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from node_agent.engine.on_device import OnDevice
from node_agent.model import packed_pooling, pooling
from node_agent.model.pooling import LoadedPooler
from shared.catalog import ModelProfile
from shared.memory import pooling_pass_bytes
from shared.wire import Pooled, Timings


@dataclass
class Encoded:
    """A job's inputs as token ids (and a pair's segment ids, for a rerank model's query + document)."""

    rows: list[list[int]]
    type_ids: list[list[int]] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.rows)


@dataclass
class _Job:
    job: str
    encoded: Encoded
    dimensions: int | None
    submitted_ms: float
    results: list[np.ndarray | float | None]
    left: int
    forwards: int = 0
    admitted_ms: float = 0.0


@dataclass
class PooledJob:
    job: str
    pooled: Pooled
    prompt_tokens: int
    timings: Timings


@dataclass
class PoolingStep:
    done: list[PooledJob] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.done


class PoolingEngine(OnDevice):
    def __init__(self, loaded: LoadedPooler, profile: ModelProfile, pack: bool = True):
        """`pack`: run passes packed where the model allows it (False: padded, as the in-process
        benchmark compares)."""
        self.lm, self.profile = loaded, profile
        self.budget = profile.pooling_batch_tokens
        self.pass_ms = profile.pooling_pass_ms
        self._ms_per_token = 0.0  # the last pass's speed (0: none run yet)
        self.packed = pack and packed_pooling.enable(loaded)
        self.forwards = 0  # passes run since load
        self._jobs: dict[str, _Job] = {}
        self._waiting: deque[tuple[str, int]] = deque()  # (job, input index), in arrival order

    @property
    def max_len(self) -> int:
        return self.lm.max_len

    @property
    def has_work(self) -> bool:
        return bool(self._waiting)

    def replica_facts(self) -> dict:
        """What a node's heartbeat says of this replica once loaded (ModelInfo's fields): its context
        (embedding and rerank models load at full precision, keep no KV cache, do not speculate)."""
        return dict(max_model_len=self.max_len)

    def memory_bytes(self) -> int:
        """Weights, plus one pass's activations (as placement counts them: shared/memory.py)."""
        config = self.lm.model.config
        activations = pooling_pass_bytes(
            self.profile,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
            max_len=self.max_len,
        )
        return pooling.memory_bytes(self.lm.model) + activations

    def add(self, job: str, encoded: Encoded, dimensions: int | None, submitted_ms: float) -> None:
        self._jobs[job] = _Job(
            job, encoded, dimensions, submitted_ms, [None] * len(encoded.rows), len(encoded.rows)
        )
        self._waiting.extend((job, i) for i in range(len(encoded.rows)))

    def cancel(self, job: str) -> None:
        if self._jobs.pop(job, None) is not None:
            self._waiting = deque(item for item in self._waiting if item[0] != job)

    def fail_all(self) -> list[str]:
        """Drop every job (a pass failed); returns their ids."""
        jobs = list(self._jobs)
        self._jobs.clear()
        self._waiting.clear()
        return jobs

    def drop_model(self) -> None:
        self.fail_all()
        self.lm.model = None

    def core_step(self) -> PoolingStep:
        if not self._waiting:  # every waiting input's job was cancelled since the step was planned
            return PoolingStep(done=[])
        chosen = self._next_pass()
        rows = [self._jobs[job].encoded.rows[i] for job, i in chosen]
        pairs = [self._jobs[job].encoded.type_ids for job, _ in chosen]
        type_ids = (
            [segments[i] for segments, (_, i) in zip(pairs, chosen)]
            if pairs[0] is not None
            else None
        )
        started_ms, started = time.time() * 1000, time.perf_counter()
        out = (
            packed_pooling.forward(self.lm, rows)
            if self.packed
            else pooling.forward(self.lm, rows, type_ids)
        )
        self._ms_per_token = (time.perf_counter() - started) * 1000 / self._pass_tokens(chosen)
        self.forwards += 1
        for job in {job for job, _ in chosen}:
            state = self._jobs[job]
            state.forwards += 1
            state.admitted_ms = state.admitted_ms or started_ms
        self._store(chosen, out)
        return PoolingStep(
            done=[
                self._done(self._jobs.pop(job))
                for job in {job for job, _ in chosen}
                if self._jobs[job].left == 0
            ]
        )

    def _next_pass(self) -> list[tuple[str, int]]:
        """The inputs of the next pass, which leave the queue: packed, those waiting longest that fit
        the budget; padded, of those waiting longest up to the budget, the longest that fit it padded
        (the others go back to the queue's front, in their order). A pass touches its window only,
        never the whole queue."""
        budget = self._budget()
        window = self._window(budget)
        if self.packed:
            return window
        chosen = sorted(window, key=lambda item: -self._length(item))
        chosen = chosen[: max(1, budget // self._length(chosen[0]))]
        taken = set(chosen)
        self._waiting.extendleft(reversed([item for item in window if item not in taken]))
        return chosen

    def _budget(self) -> int:
        """This pass's tokens at most: `pooling_batch_tokens`, or while the device is shared, what
        fits `pooling_pass_ms` at the last pass's speed."""
        if not (self.shares_device and self.pass_ms and self._ms_per_token):
            return self.budget
        return max(1, min(self.budget, int(self.pass_ms / self._ms_per_token)))

    def _pass_tokens(self, chosen: list[tuple[str, int]]) -> int:
        """The tokens a pass over `chosen` computes (padded: each row as long as the longest)."""
        lengths = [self._length(item) for item in chosen]
        return sum(lengths) if self.packed else max(lengths) * len(lengths)

    def _window(self, budget: int) -> list[tuple[str, int]]:
        """The inputs waiting longest (one at least), taken off the queue: packed, as many as fit
        `budget`; padded, up to the first that reaches it."""
        window, tokens = [], 0
        while self._waiting:
            length = self._length(self._waiting[0])
            if window and (tokens + length > budget if self.packed else tokens >= budget):
                break
            window.append(self._waiting.popleft())
            tokens += length
        return window

    def _length(self, item: tuple[str, int]) -> int:
        job, i = item
        return len(self._jobs[job].encoded.rows[i])

    def _store(self, chosen: list[tuple[str, int]], out) -> None:
        """Each pooled row into its job's results: scores as they are; vectors finished (cut to the
        job's dimensions, normalised) together for the rows that ask the same dimensions."""
        if self.lm.pooling is None:
            values = out.tolist()
        else:
            values = [None] * len(chosen)
            by_dimensions: dict[int | None, list[int]] = {}
            for n, (job, _) in enumerate(chosen):
                by_dimensions.setdefault(self._jobs[job].dimensions, []).append(n)
            for dimensions, rows in by_dimensions.items():
                finished = pooling.finish(out[rows], self.lm.pooling.normalize, dimensions)
                for n, vector in zip(rows, finished.cpu().numpy().astype("<f4")):
                    values[n] = vector
        for (job, i), value in zip(chosen, values):
            self._jobs[job].results[i] = value
            self._jobs[job].left -= 1

    def _done(self, job: _Job) -> PooledJob:
        now_ms = time.time() * 1000
        if self.lm.pooling is None:
            pooled = Pooled(scores=list(job.results), forwards=job.forwards)
        else:
            pooled = Pooled(
                vectors=[vector.tobytes() for vector in job.results], forwards=job.forwards
            )
        timings = Timings(
            queue_ms=job.admitted_ms - job.submitted_ms, prefill_ms=now_ms - job.admitted_ms
        )
        return PooledJob(job.job, pooled, job.encoded.tokens, timings)
