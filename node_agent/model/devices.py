"""Device discovery: CUDA devices through torch, else one CPU device; torch's threads on a CPU node."""

import os
from pathlib import Path

import torch

from node_agent.model import cpu_kernels
from shared.heartbeat import DeviceInfo

_MB = 1 << 20


class DeviceFault(RuntimeError):
    """A failure that leaves a model unusable on its device(s) (a tensor-parallel rank lost, say):
    the model is poisoned and reloaded."""


def discover(requested: str = "auto", cpu_devices: int = 1) -> list[str]:
    """Device ids this node should use: every CUDA device, or the CPU: "cpu", or with
    `cpu_devices` > 1 that many logical CPU devices "cpu:0", "cpu:1", … (for tensor-parallel
    tests and CPU fleets; they share the host's cores and memory)."""
    if requested != "auto" and requested != "cpu":
        return [requested]
    if requested == "auto" and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"] if cpu_devices == 1 else [f"cpu:{i}" for i in range(cpu_devices)]


def node_torch_threads(setting: int, device_ids: list[str], agents: int = 1) -> int | None:
    """Torch's intra-op threads on a node: `torch_threads` when set; else, when the node serves on
    the CPU, its share of the cores it may use with `agents` node agents on its host (all of them
    alone; node_agent/host_share.py); None (torch's own default) on a GPU. The node's other work
    (its event loop, output process, a gateway and Redis beside it) took 0.05 cores of 2 while
    serving the default model; its forwards ran 1.35-1.85x faster on 2 threads than on 1 (through
    the gateway, 128-token streams: 25.1 / 168 / 327 tok/s at N = 1 / 8 / 32 against 18.3 / 123 /
    221; docs/benchmarks.md). Agents sharing the cores must not each take them all: OpenMP threads
    that share a core stall each other at every op."""
    if setting:
        return setting
    if not all(is_cpu(d) for d in device_ids):
        return None
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, cores // max(agents, 1))


def cpu_list(spec: str, threads: int) -> list[int]:
    """The CPUs a CPU node's `threads` torch threads are bound to, one each, from the `cpu_bind`
    setting: "auto" (the first `threads` CPUs this process may run on) or a list as vLLM's
    VLLM_CPU_OMP_THREADS_BIND takes it ("0-7", "0,2,4,6", "0-3,8-11"), each CPU one this process may
    run on. ValueError with the reason otherwise."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "auto":
        cpus = allowed[:threads]
    else:
        try:
            cpus = [cpu for part in spec.split(",") for cpu in _cpu_range(part.strip())]
        except ValueError:
            raise ValueError(
                f"cpu_bind {spec!r}: give 'auto' or CPUs as '0-7' or '0,2,4,6'"
            ) from None
    outside = sorted(set(cpus) - set(allowed))
    if outside or len(set(cpus)) != len(cpus) or len(cpus) < threads:
        raise ValueError(
            f"cpu_bind {spec!r}: {threads} torch threads need as many distinct CPUs of those this "
            f"process may use ({','.join(map(str, allowed))})"
            + (f"; {outside} are not among them" if outside else "")
        )
    return cpus[:threads]


def _cpu_range(part: str) -> list[int]:
    first, _, last = part.partition("-")
    return list(range(int(first), int(last or first) + 1))


def bind_threads(spec: str) -> list[int]:
    """Bind torch's OpenMP threads of the calling thread (a CPU device's thread: its forwards' team)
    one to a CPU each, as `cpu_list` names them; returns the CPU each thread runs on. On a 2-vCPU
    host it changed nothing measurable (docs/benchmarks.md); on a host with several NUMA nodes it
    keeps each thread, and the memory it touches first, on one node, as vLLM-CPU does."""
    cpus = cpu_list(spec, torch.get_num_threads())
    if not cpu_kernels.load():
        raise RuntimeError(
            "cpu_bind needs the node's CPU kernels, which could not be built here (see the log)"
        )
    return list(torch.ops.cortex.bind_threads(cpus))


def torch_device(device: str) -> torch.device:
    """The torch device behind a device id: every logical CPU device is torch's one CPU."""
    return torch.device("cpu") if is_cpu(device) else torch.device(device)


def is_cpu(device: str) -> bool:
    return device == "cpu" or device.startswith("cpu:")


def describe(device: str) -> DeviceInfo:
    """Name and total/free memory; call it on the thread that owns the device."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        free, total = torch.cuda.mem_get_info(index)
        return DeviceInfo(
            id=device,
            name=torch.cuda.get_device_name(index),
            total_mb=total // _MB,
            free_mb=free // _MB,
        )
    total, available = host_memory()
    return DeviceInfo(id=device, name=_cpu_name(), total_mb=total // _MB, free_mb=available // _MB)


MEMINFO = Path("/proc/meminfo")


def host_memory() -> tuple[int, int]:
    """The host's (total, available) memory in bytes. Available is the kernel's MemAvailable: what
    can be allocated without swapping, page cache included (a host that has read model files keeps
    gigabytes of it), not MemFree. Without /proc/meminfo (or a kernel older than 3.14), MemFree."""
    try:
        fields = dict(
            line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line
        )
        return _kib(fields["MemTotal"]), _kib(fields["MemAvailable"])
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _kib(value: str) -> int:
    """`  8388608 kB` -> bytes."""
    number, unit = value.split()
    if unit != "kB":
        raise ValueError(f"unexpected unit {unit!r} in /proc/meminfo")
    return int(number) * 1024


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX-512 bf16: bf16 matmuls run ~3x faster than fp32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtype(device: str) -> torch.dtype:
    if not is_cpu(device) or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def give_back_memory(device: torch.device) -> None:
    """Return the memory torch's caching allocator holds unused on `device` (after an engine is dropped)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_device_fault(exc: BaseException, device: torch.device) -> bool:
    """Whether a failed engine step left the device broken (out of memory, a CUDA error), so the
    model must be reloaded, rather than failing on something the next step will not meet again.
    Call it on the device's thread."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError, DeviceFault)):
        return True
    if device.type != "cuda":
        return False
    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA" in str(exc):
        return True
    try:  # an asynchronous fault shows on the next synchronising call
        torch.ones(1, device=device).add_(1).item()
        torch.cuda.synchronize(device)
    except Exception:
        return True
    return False
