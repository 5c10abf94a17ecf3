"""A CPU device's memory: the kernel's MemAvailable (page cache included), not MemFree; a CPU node's torch threads
and their binding to CPUs."""

import os
import threading

import pytest
import torch

from node_agent.model import devices

# A host that has read model files: 209 MB free, 8.4 GB in the page cache, 8.4 GB available.
MEMINFO_WITH_PAGE_CACHE = """\
MemTotal:       24654372 kB
MemFree:          214016 kB
MemAvailable:    8601600 kB
Buffers:          102400 kB
Cached:          8396800 kB
SwapCached:            0 kB
Active:          9437184 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


@pytest.fixture
def meminfo(tmp_path, monkeypatch):
    path = tmp_path / "meminfo"
    monkeypatch.setattr(devices, "MEMINFO", path)
    return path


def test_free_memory_counts_the_page_cache(meminfo):
    meminfo.write_text(MEMINFO_WITH_PAGE_CACHE)

    assert devices.host_memory() == (24654372 * 1024, 8601600 * 1024)
    info = devices.describe("cpu")
    assert (info.total_mb, info.free_mb) == (24076, 8400)  # MemFree alone would say 209 MB


def test_without_mem_available_it_falls_back_to_mem_free(meminfo):
    meminfo.write_text(MEMINFO_WITH_PAGE_CACHE.replace("MemAvailable:    8601600 kB\n", ""))
    page = os.sysconf("SC_PAGE_SIZE")
    total, available = devices.host_memory()
    assert total == os.sysconf("SC_PHYS_PAGES") * page
    assert (
        abs(available - os.sysconf("SC_AVPHYS_PAGES") * page) < 1 << 30
    )  # MemFree moves while we read it


def test_a_cpu_node_runs_torch_on_every_core_it_may_use_unless_told():
    assert devices.node_torch_threads(0, ["cpu"]) == len(os.sched_getaffinity(0))
    assert devices.node_torch_threads(3, ["cpu"]) == 3
    assert devices.node_torch_threads(0, ["cuda:0"]) is None  # torch's own choice on a GPU


def test_cpu_bind_names_the_cpus_each_torch_thread_takes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 8, 9})
    assert devices.cpu_list("auto", 3) == [0, 1, 2]
    assert devices.cpu_list("8-9,0-1", 4) == [8, 9, 0, 1]  # vLLM's VLLM_CPU_OMP_THREADS_BIND form
    assert devices.cpu_list("3,2,1", 2) == [3, 2]
    for spec, threads, why in [
        ("0-15", 2, "[4, 5, 6, 7, 10, 11, 12, 13, 14, 15] are not among them"),
        ("0,0", 2, "2 torch threads need as many distinct CPUs"),
        ("0-1", 3, "3 torch threads"),
        ("auto", 7, "7 torch threads"),
        ("cores", 2, "give 'auto' or CPUs as '0-7'"),
    ]:
        with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
            devices.cpu_list(spec, threads)


def test_binding_places_each_torch_thread_of_the_calling_threads_team_on_its_cpu():
    """Bound from a thread of its own (as the node's device thread), so the test process's own team
    stays unbound: thread i runs on the i-th CPU named."""
    from node_agent.model import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("the CPU kernels could not be built here (see the log)")
    wanted = list(reversed(sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]))
    placed: list = []
    thread = threading.Thread(
        target=lambda: placed.append(devices.bind_threads(",".join(map(str, wanted))))
    )
    thread.start()
    thread.join()
    assert placed == [wanted]
