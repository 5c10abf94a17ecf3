"""A node restarted with a warm compile cache loads the default model (float32: its decode step
compiled, node_agent/model/compiled_step.py) without compiling anything: Inductor's caches under the
node's `compile_cache` folder leave only the trace to redo (every graph a cache hit, none generated).
Each load is a fresh process, as a restart is; the times are printed, never asserted (on a quiet
2-core EPYC: eager 33 s, compiling 106 s, warm 50 s; on a loaded one the trace alone took minutes)."""

import json
import os
import subprocess
import sys

import pytest

LOAD = """
import json, sys, time
started = time.perf_counter()
from pathlib import Path
from node_agent.engine.engine import Engine
from node_agent.model import loader
from shared.catalog import Catalog
profile = Catalog.load(None).resolve("default").model_copy(update={"quant": "none", "dtype": "float32"})
engine = Engine(loader.load(profile, "cpu"), profile, "test", Path(sys.argv[1]) if sys.argv[1] else None)
from torch._dynamo.utils import counters
print(json.dumps({"seconds": time.perf_counter() - started, "decode": engine.decoder.name,
                  "graphs": dict(counters["inductor"])}))
"""


def load(compile_cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, compile_cache],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def generated(load: dict) -> int:
    """Graphs Inductor compiled (generated code for) in the load, rather than read from its cache."""
    return load["graphs"].get("fxgraph_cache_miss", 0)


@pytest.mark.slow  # four loads of the default model, one of them compiling its step (1-2 minutes)
@pytest.mark.timeout(1200)
def test_a_restart_with_a_warm_compile_cache_compiles_nothing(tmp_path):
    load("")  # the dequantised copy written, the files in the page cache
    eager = load("")
    folder = str(tmp_path / "compiled")
    cold, warm = load(folder), load(folder)
    assert eager["decode"] == "eager" and cold["decode"] == warm["decode"] == "compiled"
    assert generated(cold) > 0 and generated(warm) == 0, (cold, warm)
    assert warm["graphs"].get("fxgraph_cache_hit", 0) == generated(cold), (cold, warm)
    print(
        f"eager {eager['seconds']:.1f} s, compiling {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s "
        f"({generated(cold)} graphs compiled, read back)"
    )
