"""The node's C++ CPU kernels (node_agent/model/csrc/): attention read in place from the paged KV
cache (paged_attention.cpp, node_agent/model/cpu_attention.py), torch's OpenMP threads bound to
CPUs (cpu_threads.cpp, node_agent/model/devices.py), 4-bit layers' matmul (int4_matmul.cpp,
node_agent/model/int4_tiles.py), an output head of 8-bit groups read as stored (int8_group_matmul.cpp,
node_agent/model/int8_groups_cpu.py) and LoRA adapters' updates (lora_update.cpp,
node_agent/model/lora_layers.py), as torch operators in one library.

Compiled at the first load of a CPU model on this machine (~25 s, g++ and the Python headers;
`torch.utils.cpp_extension`) and cached (`TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions), keyed by the sources, torch's version and this CPU's instruction set.
Where they cannot be built, a log line says why and each user goes on without them."""

import contextlib
import fcntl
import functools
import hashlib
import logging
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "cpu_threads.cpp",
        "int4_matmul.cpp",
        "int8_group_matmul.cpp",
        "lora_update.cpp",
    )
]


def library_name() -> str:
    """The build's name, keyed by the sources, torch's version and this CPU's instruction set."""
    flags = (
        Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0]
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    digest = hashlib.sha256(
        b"".join(source.read_bytes() for source in _SOURCES)
        + torch.__version__.encode()
        + flags.encode()
    ).hexdigest()[:12]
    return f"cortex_cpu_kernels_{digest}"


@functools.cache
def load() -> bool:
    """Whether the torch.ops.cortex operators are there (built and loaded here, or logged why not).
    A process loads one build: a second library registering the same operators aborts."""
    if registered():
        return True
    name = library_name()
    try:
        from torch.utils.cpp_extension import load as build

        with _only_builder(name):
            build(
                name=name,
                sources=[str(source) for source in _SOURCES],
                is_python_module=False,
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-ffast-math",
                    "-fno-finite-math-only",
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers, a read-only cache
        log.warning(
            "the CPU kernels could not be built (%s: %s): decode attention reads the KV cache through a "
            "copy, prefill runs torch's flash attention, and OpenMP threads cannot be bound to CPUs",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return False
    return True


@contextlib.contextmanager
def _only_builder(name: str) -> Iterator[None]:
    """Hold this machine's lock on building `name` (an flock, which the kernel drops when its
    process ends, however it ends) and clear torch's own lock file if one was left there: torch
    waits forever on a `lock` file whose builder was killed mid-build (a node stopped while
    loading its first model), and every later CPU model load on the machine would hang on it.
    """
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    with open(directory.parent / f"{name}.building", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        left = directory / "lock"
        if left.exists():  # no process holds the flock but us: nobody is building it
            log.warning("removing %s, left by a build of the CPU kernels that was killed", left)
            left.unlink(missing_ok=True)
        yield


def registered() -> bool:
    return torch._C._dispatch_has_kernel("cortex::paged_decode_attention")
