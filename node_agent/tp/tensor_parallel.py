"""Tensor parallelism (a profile's `tensor_parallel = N`): one model sharded over N devices of one
node with transformers' own TP plan (quantized weights: each rank's part cut by the node's own
loaders along the same plan, node_agent/model/linear_shards.py).

Rank 0 is the device thread of the model's first device: it runs the engine as for one device.
Ranks 1..N-1 are worker processes (node_agent/tp/tp_worker.py), spawned one per further device, each
owning its device. Every model call the engine makes (node_agent/model/model_calls.py) goes first to
the workers over one channel of fixed-shape ops (node_agent/tp/tp_channel.py), then runs on rank 0
too, so all ranks run the same forward with the same inputs; only rank 0 samples and emits.
Loads start the workers (they load with rank 0: `from_pretrained` is collective), unloads stop
them. A request event (cancel, disconnect, drain, one job's error) only changes what rank 0 sends
next; it never interrupts a call half-way.

Every collective has a timeout (`tp_timeout_s`). A rank that dies (a killed worker closes its
connections: rank 0's next collective raises at once), hangs past the timeout or raises makes
the call raise `RankFailed`, a device fault: the model is poisoned, its jobs fail with a 503,
every rank is torn down (workers killed and reaped, the process group destroyed) and the model
is loaded again with fresh workers and a new rendezvous port.

The process group is the process's default one, so a node agent runs one tensor-parallel model
at a time; a second one is refused at load. CPU devices use gloo, CUDA devices NCCL (the channel
always gloo)."""

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoConfig

from node_agent.model import devices, forward, kv_cache, loader, vision
from node_agent.model.kv_cache import PagedCache
from node_agent.model.model_calls import ModelCalls
from node_agent.tp import tp_worker
from node_agent.tp.tp_channel import RENDEZVOUS_TIMEOUT, Channel, Op, backend, joined_key
from shared.catalog import ModelProfile
from shared.model_files import ModelLoadError, locate
from shared.processes import free_port
from shared.settings import NodeSettings

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a stopped worker gets this long to leave before it is killed


class RankFailed(devices.DeviceFault):
    """A rank died, hung past the collective timeout, or raised: the group is out of step."""


def check(profile: ModelProfile, config, device_ids: list[str], node: str = "") -> None:
    """Refuse, before any process starts, what tensor parallelism cannot run (ModelLoadError)."""
    n = profile.tensor_parallel
    if profile.vision or vision.is_vision(config):
        raise ModelLoadError(
            f"vision models are not tested with tensor parallelism; run {profile.id} with "
            "tensor_parallel = 1"
        )
    if len(device_ids) < n:
        raise ModelLoadError(
            f"tensor_parallel = {n} needs {n} devices on one node; {node or 'this node'} has "
            f"{len(device_ids)} ({', '.join(device_ids)})"
        )
    if not getattr(config, "base_model_tp_plan", None):
        raise ModelLoadError(
            f"model_type '{config.model_type}' has no tensor-parallel plan in transformers; "
            f"run it with tensor_parallel = 1"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % n or kv_heads % n:
        raise ModelLoadError(
            f"tensor_parallel = {n} must divide the attention heads ({heads}) and the key/value "
            f"heads ({kv_heads}) of {profile.id}"
        )
    others = sorted(set(kv_cache.layer_types(config)) - {kv_cache.FULL})
    if others:
        raise ModelLoadError(
            f"tensor parallelism is tested with full-attention layers only; {profile.id} has "
            f"{', '.join(others)} layers"
        )
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ModelLoadError(
            f"tensor parallelism of mixture-of-experts models is not tested; run {profile.id} "
            "with tensor_parallel = 1"
        )
    if profile.kv_memory_fraction is not None:
        raise ModelLoadError(
            "every rank must hold as many KV blocks, and kv_memory_fraction sizes each device's cache "
            f"from its own free memory: give {profile.id} a kv_cache_mb instead"
        )
    RankGroup.refuse_second()


class RankGroup:
    """Rank 0's side of the group: the worker processes and the channel to them. One at a time
    per process: it owns the process's default process group."""

    _active: "RankGroup | None" = None
    _claim = threading.Lock()

    @classmethod
    def refuse_second(cls) -> None:
        active = cls._active
        if active is not None or dist.is_initialized():
            raise ModelLoadError(
                f"this node agent already runs tensor-parallel model "
                f"{active.profile.id if active else '(unknown)'}; one per node agent process (it "
                "owns the process group): unload it first or use another node"
            )

    def __init__(self, profile: ModelProfile, device_ids: list[str], settings: NodeSettings):
        self.profile, self.device_ids = profile, device_ids
        self.timeout = timedelta(seconds=settings.tp_timeout_s)  # for collectives once loaded
        self.port = (
            free_port()
        )  # the rendezvous (a TCP store rank 0 serves); a new one for every load
        self.channel: Channel | None = None  # once every rank holds its cache (`calls`)
        self.broken: BaseException | None = None
        spawn = multiprocessing.get_context("spawn")
        self.workers = [
            spawn.Process(
                target=tp_worker.main,
                name=f"cortex-tp-{profile.id}-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    len(device_ids),
                    self.port,
                    profile.model_dump_json(),
                    device,
                    settings.hf_cache,
                    settings.tp_timeout_s,
                    settings.torch_threads,
                ),
            )
            for rank, device in enumerate(device_ids)
            if rank > 0
        ]

    def start(self) -> None:
        with RankGroup._claim:  # two loads on two device threads must not both pass the check
            RankGroup.refuse_second()
            RankGroup._active = self
        first = devices.torch_device(self.device_ids[0])
        if (
            first.type == "cuda"
        ):  # transformers binds each rank's shard to the device LOCAL_RANK names
            os.environ["LOCAL_RANK"] = str(first.index or 0)
            torch.cuda.set_device(first)
        for worker in self.workers:
            worker.start()
        log.info(
            "%s: rank 0 on %s (this process), workers %s",
            self.profile.id,
            self.device_ids[0],
            ", ".join(
                f"rank {r} on {d} pid {w.pid}"
                for r, (d, w) in enumerate(zip(self.device_ids[1:], self.workers), 1)
            ),
        )
        store = dist.TCPStore(
            "127.0.0.1",
            self.port,
            len(self.device_ids),
            is_master=True,
            timeout=RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
        )
        self._await_workers(store)
        dist.init_process_group(
            backend(self.device_ids[0]),
            store=store,
            rank=0,
            world_size=len(self.device_ids),
            timeout=RENDEZVOUS_TIMEOUT,
        )
        self.channel_group = dist.new_group(backend="gloo", timeout=RENDEZVOUS_TIMEOUT)

    def _await_workers(self, store: dist.TCPStore) -> None:
        """Wait until every worker has joined the store; one that exits first fails the load at once
        (rather than after the rendezvous timeout)."""
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while not store.check([joined_key(rank) for rank in range(1, len(self.device_ids))]):
            if dead := [w for w in self.workers if not w.is_alive()]:
                raise RuntimeError(
                    f"{dead[0].name} exited (code {dead[0].exitcode}) before joining; its log says why"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"workers did not join within {RENDEZVOUS_TIMEOUT.total_seconds():.0f} s"
                )
            time.sleep(0.05)

    def loaded(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Every rank holds its shard: from now on a collective waits `tp_timeout_s` at most."""
        for group in (None, self.channel_group):
            dist.distributed_c10d._set_pg_timeout(self.timeout, group)
        self.hidden_size, self.dtype = hidden_size, dtype

    def calls(self, model: torch.nn.Module, cache: PagedCache) -> "Rank0Calls":
        """Rank 0's model calls, once every rank holds its cache (a worker that could not make its
        own fails this, and with it the load)."""
        with self.op():
            dist.barrier(group=self.channel_group)
        self.channel = Channel(self.channel_group, self.hidden_size, self.dtype)
        return Rank0Calls(model, cache, self)

    @contextlib.contextmanager
    def op(self):
        """One call on every rank; any failure in it leaves the ranks out of step for good."""
        if self.broken is not None:
            raise RankFailed(f"the rank group of {self.profile.id} is broken ({self.broken})")
        try:
            yield
        except Exception as exc:
            self.broken = exc
            log.error(
                "%s: a rank failed (%s: %s); the group is torn down",
                self.profile.id,
                type(exc).__name__,
                exc,
            )
            raise RankFailed(
                f"tensor-parallel rank group of {self.profile.id} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Stop every worker (killed if broken, not yet serving ops, or slow), reap it, destroy the
        process group."""
        serving = self.channel is not None and self.broken is None
        if serving:
            with contextlib.suppress(Exception):
                self.channel.send(Op.STOP)
        else:
            for worker in self.workers:
                if worker.is_alive():
                    worker.kill()
        for worker in self.workers:
            if worker.pid is not None:
                worker.join(STOP_GRACE_S)
                if worker.is_alive():
                    log.warning("%s: %s did not stop; killing it", self.profile.id, worker.name)
                    worker.kill()
                    worker.join()
        if RankGroup._active is self:
            if dist.is_initialized():
                dist.destroy_process_group()
            RankGroup._active = None
        log.info(
            "%s: tensor-parallel group torn down (exit codes %s)",
            self.profile.id,
            [w.exitcode for w in self.workers],
        )


class Rank0Calls(ModelCalls):
    """Rank 0's model calls: each is sent to the workers, then run here."""

    def __init__(self, model: torch.nn.Module, cache: PagedCache, group: RankGroup):
        super().__init__(model, cache)
        self.group = group
        self.step = self.decode_step

    def forward(self, rows, input_ids, positions, write_pos, kv_len, **vision):
        """A prefill forward of token ids (vision models run with tensor_parallel = 1: `check`)."""
        with self.group.op():
            self.group.channel.send(
                Op.FORWARD,
                rows.start,
                *input_ids.shape,
                kv_len,
                payload=torch.stack([input_ids, positions, write_pos]),
            )
            return super().forward(rows, input_ids, positions, write_pos, kv_len)

    def logits(self, hidden):
        with self.group.op():
            flat = hidden.reshape(-1, hidden.shape[-1])
            self.group.channel.send(Op.LOGITS, flat.shape[0], payload=flat)
            return super().logits(flat).reshape(*hidden.shape[:-1], -1)

    def decode_step(self, model, cache, tokens, positions, rope_offsets, kv_len):
        """The decoder's step (node_agent/model/forward.py decode_step), run on every rank. Its rope
        offsets are all 0 (they move only after an image), so the workers take zeros."""
        with self.group.op():
            self.group.channel.send(
                Op.DECODE, tokens.shape[0], kv_len, payload=torch.stack([tokens, positions])
            )
            return forward.decode_step(model, cache, tokens, positions, rope_offsets, kv_len)

    def set_tables(self, tables):
        with self.group.op():
            self.group.channel.send(Op.TABLES, *tables.shape, payload=tables)
            super().set_tables(tables)

    def move_row(self, src, dst):
        with self.group.op():
            self.group.channel.send(Op.MOVE_ROW, src, dst)
            super().move_row(src, dst)

    def close(self) -> None:
        self.group.close()


def load(
    profile: ModelProfile, device_ids: list[str], settings: NodeSettings, node: str = ""
) -> loader.LoadedModel:
    """On rank 0's device thread: check, start the workers, load the shards on every rank."""
    files = locate(profile, settings.hf_cache)
    if files.gguf_file and not loader.weights_as_stored(files, profile):
        raise ModelLoadError(
            "a .gguf file shards with its Linear weights quantized as it stores them (quant = "
            "'auto'); dequantised, tensor_parallel needs a safetensors model (a directory or hf: source)"
        )
    config = AutoConfig.from_pretrained(files.folder, gguf_file=files.gguf_file)
    check(profile, config, device_ids, node)
    device_ids = device_ids[: profile.tensor_parallel]
    group = RankGroup(profile, device_ids, settings)
    try:
        group.start()
        loaded = loader.load(
            profile, device_ids[0], settings.hf_cache, None, tp_size=len(device_ids)
        )
        group.loaded(config.hidden_size, loaded.dtype)
    except Exception as exc:
        group.broken = exc
        group.close()
        raise ModelLoadError(
            f"loading {profile.id} over {', '.join(device_ids)} failed: {type(exc).__name__}: {exc}"
        ) from exc
    loaded.group = group
    return loaded
