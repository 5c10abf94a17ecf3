"""`scripts/bench --workload embed`: the default embedding model (all-MiniLM-L6-v2, fp32) at
batch sizes 1, 32 and 256 (`--concurrency`), in inputs per second. One client sends one request
of that many inputs at a time, again and again, for a few seconds; every system embeds the same
texts (sentences of 8-60 tokens):

  engine                 Cortex's pooling engine in-process: tokenise, add, step until done; its
                         passes packed into one row (no padding), as a CPU node runs them
  engine-padded          the same with passes padded to their longest input (sorted by length),
                         as a GPU node runs them
  gateway                Cortex end to end: POST /v1/embeddings (base64, the OpenAI SDK's
                         default) through the gateway, Redis and one node agent
  sentence-transformers  `SentenceTransformer.encode(texts, batch_size=B)` on the same folder, in a
                         process of its own; its packages are installed --no-deps on first use into
                         ~/.cache/cortex/bench-venvs/sentence-transformers (skipped, saying why, if
                         they cannot be)

A report, never an assertion. See docs/benchmarks.md."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_core import ROOT, Procs, log, wait_until

from shared import processes
from shared.processes import free_port

PY = sys.executable
MODEL = "all-MiniLM-L6-v2"
ST_TARGET = Path.home() / ".cache" / "cortex" / "bench-venvs" / "sentence-transformers"
# sentence-transformers' own requirements beyond what Cortex's venv has (torch, transformers, tqdm …)
ST_PACKAGES = [
    "sentence-transformers",
    "scipy",
    "scikit-learn",
    "joblib",
    "threadpoolctl",
    "cloudpickle",
    "narwhals",
]
MIN_SECONDS = 3.0
SUBJECTS = [
    "a lighthouse keeper",
    "the first snow of winter",
    "a robot learning to paint",
    "a bakery at dawn",
    "a train that never stops",
    "a garden on the moon",
    "a letter never sent",
    "a quiet harbour",
]


def texts(n: int) -> list[str]:
    """`n` distinct sentences, from 8 to about 60 tokens."""
    return [
        f"Sentence {i} is about {SUBJECTS[i % len(SUBJECTS)]}"
        + ", and then some more" * (i % 9)
        + "."
        for i in range(n)
    ]


def rate(embed: Callable[[list[str]], int], batch: int) -> float:
    """Inputs per second: requests of `batch` inputs, one at a time, for MIN_SECONDS at least."""
    inputs = texts(max(batch, 64))
    embed(inputs[:batch])  # warm-up: first-shape costs, caches
    done, start, i = 0, time.perf_counter(), 0
    while (elapsed := time.perf_counter() - start) < MIN_SECONDS or done < 2 * batch:
        chunk = [inputs[(i + k) % len(inputs)] for k in range(batch)]
        assert embed(chunk) == batch
        done, i = done + batch, i + batch
    return done / elapsed


def engine_rates(sizes: list[int], pack: bool) -> dict[int, float]:
    from node_agent.engine.pooler import PoolingEngine
    from node_agent.model import pooling
    from node_agent.serving.pooling_inputs import encode
    from shared.catalog import Catalog
    from shared.wire import PoolingRequest

    profile = Catalog.load(None).resolve(MODEL)
    engine = PoolingEngine(pooling.load(profile, "cpu"), profile, pack=pack)
    assert engine.packed == pack

    def embed(batch: list[str]) -> int:
        request = PoolingRequest(job="j", model=MODEL, kind="embed", inputs=batch)
        engine.add("j", encode(engine.lm, request), None, 0.0)
        done = []
        while engine.has_work:
            done += engine.core_step().done
        return len(done[0].pooled.vectors)

    return {size: rate(embed, size) for size in sizes}


def gateway_rates(sizes: list[int], workdir: Path) -> dict[int, float]:
    import httpx
    import redis

    procs = Procs(workdir)
    try:
        rport, gport = free_port(), free_port()
        procs.start("redis", processes.redis_server_argv(rport, workdir=workdir))
        wait_until(
            "redis", lambda: redis.Redis(port=rport, socket_timeout=1).ping(), 20, procs, 0.05
        )
        env = {
            **os.environ,
            "CORTEX_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
            "CORTEX_LOG_LEVEL": "WARNING",
        }
        for name in ("CORTEX_CONFIG", "CORTEX_MODELS_FILE"):  # the built-in catalogue
            env.pop(name, None)
        procs.start(
            "gateway",
            [PY, "-m", "gateway"],
            {**env, "CORTEX_HOST": "127.0.0.1", "CORTEX_PORT": str(gport)},
        )
        procs.start("node", [PY, "-m", "node_agent"], {**env, "CORTEX_MODELS": json.dumps([MODEL])})
        url = f"http://127.0.0.1:{gport}/v1/embeddings"
        client = httpx.Client(timeout=300)

        def embed(batch: list[str]) -> int:
            response = client.post(
                url, json={"model": MODEL, "input": batch, "encoding_format": "base64"}
            )
            response.raise_for_status()
            return sum(
                len(base64.b64decode(item["embedding"])) == 4 * 384
                for item in response.json()["data"]
            )

        wait_until("the embedding model ready", lambda: embed(["ready?"]) == 1, 300, procs, 0.5)
        return {size: rate(embed, size) for size in sizes}
    finally:
        procs.stop_all()


def sentence_transformers_rates(sizes: list[int]) -> dict[int, float] | str:
    """Rates measured in a child process that sees the packages; a str: why it was skipped."""
    if not (ST_TARGET / "sentence_transformers").exists():
        log(f"installing {', '.join(ST_PACKAGES)} (--no-deps) into {ST_TARGET}")
        done = subprocess.run(
            [
                PY,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(ST_TARGET),
                *ST_PACKAGES,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return f"could not install sentence-transformers: {done.stderr.strip()[-300:]}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ST_TARGET), str(ROOT / "scripts"), str(ROOT)]),
    }
    child = subprocess.run(
        [PY, __file__, ",".join(map(str, sizes))], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if child.returncode != 0:
        return f"sentence-transformers failed: {child.stderr.strip()[-300:]}"
    return {int(size): value for size, value in json.loads(child.stdout.splitlines()[-1]).items()}


def _encode_with_sentence_transformers(sizes: list[int]) -> dict[int, float]:
    from sentence_transformers import SentenceTransformer

    from shared import model_files
    from shared.catalog import Catalog

    folder = model_files.locate(Catalog.load(None).resolve(MODEL)).folder
    model = SentenceTransformer(str(folder), device="cpu")
    return {
        size: rate(lambda batch: len(model.encode(batch, batch_size=size)), size) for size in sizes
    }


def run(args, workdir: Path) -> int:
    sizes = args.concurrency
    import torch

    log(
        f"embed: {MODEL} fp32 on cpu, batch sizes {sizes}; {os.cpu_count()} CPUs, torch {torch.get_num_threads()} "
        "threads in-process"
    )
    results: dict[str, dict[int, float]] = {}
    skipped: dict[str, str] = {}
    results["engine"] = engine_rates(sizes, pack=True)
    results["engine-padded"] = engine_rates(sizes, pack=False)
    results["gateway"] = gateway_rates(sizes, workdir)
    st = sentence_transformers_rates(sizes)
    if isinstance(st, str):
        skipped["sentence-transformers"] = st
    else:
        results["sentence-transformers"] = st
    print(f"\n{'system':<24}" + "".join(f"{f'B={size}':>12}" for size in sizes) + "   (inputs/s)")
    for system, rates in results.items():
        print(f"{system:<24}" + "".join(f"{rates[size]:>12.1f}" for size in sizes))
    ratios = {
        f"gateway/{other}": {
            size: results["gateway"][size] / results[other][size] for size in sizes
        }
        for other in results
        if other != "gateway"
    }
    for name, values in ratios.items():
        print(f"{name:<24}" + "".join(f"{values[size]:>12.2f}" for size in sizes))
    for system, why in skipped.items():
        print(f"{system}: skipped: {why}")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"results": results, "ratios": ratios, "skipped": skipped}, indent=2)
        )
    return 0


if __name__ == "__main__":  # the sentence-transformers child: `bench_embed.py 1,32,256`
    print(json.dumps(_encode_with_sentence_transformers([int(s) for s in sys.argv[1].split(",")])))
