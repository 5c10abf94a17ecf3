"""A CPU device's memory: the kernel's MemAvailable (page cache included), not MemFree; a CPU node's torch threads."""

import os

import pytest

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
    assert abs(available - os.sysconf("SC_AVPHYS_PAGES") * page) < 1 << 30  # MemFree moves while we read it



def test_a_cpu_node_runs_torch_on_every_core_it_may_use_unless_told():
    assert devices.node_torch_threads(0, ["cpu"]) == len(os.sched_getaffinity(0))
    assert devices.node_torch_threads(3, ["cpu"]) == 3
    assert devices.node_torch_threads(0, ["cuda:0"]) is None  # torch's own choice on a GPU
