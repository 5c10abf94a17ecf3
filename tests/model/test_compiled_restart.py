"""A node restarted with a warm compile cache loads the default model (float32: its decode step
compiled, node_agent/model/compiled_step.py) in under twice the time an eager load takes: Inductor's
caches under the node's `compile_cache` folder leave only the trace to redo. Each load is a fresh
process, as a restart is."""

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
print(json.dumps({"seconds": time.perf_counter() - started, "decode": engine.decoder.name}))
"""


def load(compile_cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, compile_cache],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # four loads of the default model, one of them compiling its step (1-2 minutes)
@pytest.mark.timeout(900)
def test_a_restart_with_a_warm_compile_cache_loads_in_under_twice_the_eager_time(tmp_path):
    load("")  # the dequantised copy written, the files in the page cache
    eager = load("")
    folder = str(tmp_path / "compiled")
    cold, warm = load(folder), load(folder)
    assert eager["decode"] == "eager" and cold["decode"] == warm["decode"] == "compiled"
    assert warm["seconds"] < 2 * eager["seconds"], (eager, cold, warm)
    print(
        f"eager {eager['seconds']:.1f} s, compiling {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s"
    )
