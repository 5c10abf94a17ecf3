"""`scripts/bench --workload wake`: what waking a sleeping model costs beside a cold load (issue 52).

One stack (redis-server, a gateway, one node agent with `sleep_mb` and no model at start), the
default model as shipped (`--model`: another catalogue id) with `keep_alive_s = --keep-alive-s`.
For each of `--rounds` rounds, in order:
1. cold: the model unloaded (`POST /admin/models/{id}/unload`), one chat request: its time to the
   first token holds placement, the node's load (files read, weights converted or read from the
   converted copy, the engine built, its decode step compiled or read from the compile cache) and
   the answer's first token;
2. ready: the same request to the model loaded: the answer's own time to the first token;
3. wake: once the node's heartbeat says `sleeping` (idle past its keep_alive), the same request: its
   time to the first token holds placement's wake command and the wake.
Printed: each round's three figures, the medians, and wake / cold (both less the ready answer).
Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_core import Procs, log, wait_until  # noqa: E402
from bench_servers import Served, openai_body, request  # noqa: E402

from shared import processes  # noqa: E402
from shared.catalog import Catalog  # noqa: E402
from shared.processes import free_port  # noqa: E402

PY = sys.executable
ADMIN_KEY = "bench-admin"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench --workload wake")
    p.add_argument("--workload", default="wake")
    p.add_argument("--model", default="default", help="a catalogue id or alias (the shipped one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep-alive-s", type=float, default=3.0)
    p.add_argument("--json", type=Path, help="write the figures here too")
    return p.parse_args(argv)


def toml_value(value) -> str:
    return json.dumps(value)  # strings, numbers, booleans and lists of them read the same in TOML


def catalogue(model: str, keep_alive_s: float, path: Path) -> str:
    """The model's shipped profile, with the bench's keep_alive, as the node's catalogue."""
    profile = Catalog.load(None).resolve(model)
    entry = profile.model_dump(exclude_defaults=True, mode="json") | {"keep_alive_s": keep_alive_s}
    path.write_text("[[models]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in entry.items()))
    return profile.id


def ttft_s(url: str, model: str) -> float:
    """One streamed chat's time to its first token, in seconds."""
    served = Served("gateway", url, openai_body(model))
    stream = request(served, [{"role": "user", "content": "Say hello."}], 4, 600)
    if stream.error:
        raise RuntimeError(stream.error)
    return stream.ttft_s


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx
    import redis

    from shared.heartbeat import NodeHeartbeat
    from shared.keys import Keys

    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-wake-"))
    procs = Procs(workdir)
    rounds = []
    try:
        rport, gport = free_port(), free_port()
        procs.start("redis", processes.redis_server_argv(rport, workdir=workdir))
        r = redis.Redis(port=rport, socket_timeout=2)
        wait_until("redis", r.ping, 20, procs, 0.05)
        model = catalogue(args.model, args.keep_alive_s, workdir / "models.toml")
        env = {
            **os.environ,
            "CORTEX_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
            "CORTEX_MODELS_FILE": str(workdir / "models.toml"),
            "CORTEX_ADMIN_KEY": ADMIN_KEY,
            "CORTEX_LOG_LEVEL": os.environ.get("CORTEX_LOG_LEVEL", "INFO"),
        }
        env.pop("CORTEX_CONFIG", None)
        procs.start(
            "gateway",
            [PY, "-m", "gateway"],
            env | {"CORTEX_HOST": "127.0.0.1", "CORTEX_PORT": str(gport)},
        )
        procs.start(
            "node",
            [PY, "-m", "node_agent"],
            env
            | {
                "CORTEX_NODE_NAME": "bench-node",
                "CORTEX_MODELS": "[]",
                "CORTEX_SLEEP_MB": "100000",
            },
        )
        url, keys = f"http://127.0.0.1:{gport}", Keys()

        def state() -> str | None:
            beat = r.hgetall(keys.node("bench-node"))
            info = NodeHeartbeat.from_hash(beat).models.get(model) if beat else None
            return info.state if info else None

        wait_until("the node", lambda: r.exists(keys.node("bench-node")), 120, procs)
        wait_until("the gateway", lambda: httpx.get(url + "/health").status_code == 200, 60, procs)
        ttft_s(url, model)  # the first load: converted copy written, files in the page cache
        for i in range(args.rounds):
            unloaded = httpx.post(
                f"{url}/admin/models/{model}/unload",
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
                timeout=120,
            )
            unloaded.raise_for_status()
            wait_until("the unload", lambda: state() is None, 120, procs)
            cold = ttft_s(url, model)
            ready = ttft_s(url, model)
            wait_until("the model asleep", lambda: state() == "sleeping", 120, procs)
            wake = ttft_s(url, model)
            rounds.append({"cold_s": cold, "ready_s": ready, "wake_s": wake})
            log(f"round {i + 1}: cold {cold:.2f} s, ready {ready:.3f} s, wake {wake:.2f} s")
    finally:
        procs.stop_all()
    medians = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    ratio = (medians["wake_s"] - medians["ready_s"]) / (medians["cold_s"] - medians["ready_s"])
    print(f"\nwake: {model}, {args.rounds} rounds (time to the first token, medians)")
    print("| cold load | ready | wake | wake / cold (less the ready answer) |")
    print("|--:|--:|--:|--:|")
    print(
        f"| {medians['cold_s']:.2f} s | {medians['ready_s']:.3f} s | {medians['wake_s']:.2f} s "
        f"| {ratio:.3f} |"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"model": model, "rounds": rounds, "medians": medians, "ratio": ratio})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
