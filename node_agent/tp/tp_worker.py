"""A tensor-parallel worker: one process per rank beyond 0, owning one device. It joins rank 0's
process group, loads its shard of the model (with the other ranks), builds its share of the slot
cache, then replays the ops rank 0 sends (node_agent/tp/tp_channel.py) until STOP. It never sees a
request: only op numbers and tensors. Any error ends the process, which rank 0 sees at its next
collective (and poisons the model)."""

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from node_agent.model import devices, forward, loader
from node_agent.model.model_calls import ModelCalls, paged_cache
from node_agent.tp.tp_channel import RENDEZVOUS_TIMEOUT, Channel, Op, backend, joined_key
from shared.catalog import ModelProfile

IDLE_TIMEOUT = timedelta(days=365)  # waiting for rank 0's next op: idle models wait for long

log = logging.getLogger("node_agent.tp.tp_worker")


def main(
    rank: int,
    world: int,
    port: int,
    profile_json: str,
    device: str,
    hf_cache: str | None,
    timeout_s: float,
    torch_threads: int,
) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s"
    )
    hf_logging.disable_progress_bar()  # the node's log has rank 0's bar already
    if torch_threads:
        torch.set_num_threads(torch_threads)
    torch_device = devices.torch_device(device)
    if torch_device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(torch_device.index or 0)
        torch.cuda.set_device(torch_device)
    profile = ModelProfile.model_validate_json(profile_json)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        store.set(joined_key(rank), "1")
        dist.init_process_group(
            backend(device), store=store, rank=rank, world_size=world, timeout=RENDEZVOUS_TIMEOUT
        )
        channel_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        loaded = loader.load(profile, device, hf_cache, None, tp_size=world)
        dist.distributed_c10d._set_pg_timeout(
            timedelta(seconds=timeout_s)
        )  # the model's collectives
        calls = ModelCalls(loaded.model, paged_cache(loaded, profile))
        channel = Channel(channel_group, loaded.model.config.hidden_size, loaded.dtype)
        dist.barrier(group=channel_group)  # rank 0 waits here for every rank's cache
        log.info(
            "%s: rank %d of %d on %s ready (pid %d, %d bytes of weights)",
            profile.id,
            rank,
            world,
            device,
            os.getpid(),
            loaded.weight_bytes,
        )
        serve(channel, calls, loaded.device)
        log.info("%s: rank %d stopped", profile.id, rank)
    except Exception:
        log.exception("%s: rank %d failed; leaving the group", profile.id, rank)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def serve(channel, calls, device: torch.device) -> None:
    """Replay rank 0's ops until STOP."""
    while True:
        op, numbers, payload = channel.receive()
        if payload is not None:
            payload = payload.to(device)
        if op == Op.STOP:
            return
        if op == Op.FORWARD:
            start, batch, _width, kv_len = numbers
            calls.forward(slice(start, start + batch), payload[0], payload[1], payload[2], kv_len)
        elif op == Op.LOGITS:
            calls.logits(payload)
        elif op == Op.DECODE:
            forward.decode_step(
                calls.model,
                calls.cache,
                payload[0],
                payload[1],
                torch.zeros_like(payload[1]),
                numbers[1],
            )
        elif op == Op.MOVE_ROW:
            calls.move_row(*numbers[:2])
        elif op == Op.TABLES:
            calls.set_tables(payload)
