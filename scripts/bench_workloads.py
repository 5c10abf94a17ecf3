"""The prefix-caching workloads of `scripts/bench` (issue 19): what a server gains by keeping the KV
of a prompt it has seen before. Each runs against every HTTP system in turn (Cortex's gateway,
vLLM on CPU, transformers serve), one after another, with the same texts, greedy, exactly
`--answer-tokens` completion tokens a request (EOS ignored).

multiturn      A agents at once, each with its own long system prompt, T turns each, one after another
               (`--think-ms` apart): every turn resends the whole conversation so far (system prompt,
               earlier user turns and the assistant's actual answers) plus a new user message. Later
               turns can reuse the KV of everything but the new message; the first turn cannot.
shared-prefix  N requests, C at a time, that share one long system prompt and differ in a short question.

With `--speculative` settings other than off, Cortex's gateway runs once per setting (`gateway`,
`gateway ngram`, `gateway suffix`, each a fresh stack), and the speculating ones report the draft
tokens they checked during the workload and the share accepted (the gateway's /metrics).

With `--kv-host-mb M` Cortex's gateway runs again with M MB of host-memory KV tier (`gateway host`,
issue 52), ratios against `gateway`: set `--kv-cache-mb` to a device pool smaller than the prefixes.
With `--kv-disk-restart` (multiturn) a node with a KV disk tier answers the first agent's system prompt
with a new question, fresh (cold), then again after a restart on the same disk (warm).

With `--nodes N` (2 or more) the systems are Cortex alone: one node (the hit rate's reference), then
a fleet of N nodes with routing on (`cache`: a conversation's next turn goes to the node holding its
prefix) and off (`none`: whichever node is free), each fleet fresh (issue 20).

A workload runs once per system and is never rerun (a second run would find the first one's prefixes
cached); a run during which other processes took more than NOISY_PCT of the CPU is flagged noisy.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import bench_models
import bench_text
from bench_core import NOISY_PCT, CpuMeter, Stream, Wave, fmt, log, one_http, percentile, verdict
from bench_servers import (
    FLEET,
    HOST_TIER,
    NAMES,
    SPECULATIVE,
    Served,
    cortex_gateway,
    each_served,
    http_servers,
    label,
    peers_folder,
    request,
    spec_delta,
    speculating,
    warm_up,
)

TEMPLATE_TOKENS = 8  # what the chat template adds around one message (SmolLM2's ChatML: 5)


def _client(connections: int, timeout_s: float):
    import httpx

    limits = httpx.Limits(
        max_connections=connections + 4, max_keepalive_connections=connections + 4
    )
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30))


def cached_pct(streams: list[Stream]) -> float:
    """The share of prompt tokens the server said it took from its cache (NaN if it did not say)."""
    known = [s for s in streams if s.cached_tokens is not None and s.prompt_tokens]
    return (
        100 * sum(s.cached_tokens for s in known) / sum(s.prompt_tokens for s in known)
        if known
        else math.nan
    )


# ---- multiturn ----------------------------------------------------------------------------------


def multiturn_texts(tokenizer, args) -> tuple[list[str], list[list[str]]]:
    """Each agent's system prompt and its user messages, one a turn."""
    systems = [
        bench_text.system_prompt(tokenizer, a, args.system_tokens) for a in range(args.agents)
    ]
    users = [
        [bench_text.user_turn(tokenizer, a, t, args.user_tokens) for t in range(args.turns)]
        for a in range(args.agents)
    ]
    return systems, users


def longest_multiturn(tokenizer, texts, args) -> int:
    """Tokens of the longest conversation at its last turn, answer included."""
    systems, users = texts
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False)) + TEMPLATE_TOKENS  # noqa: E731
    return max(
        count(s) + sum(map(count, u)) + args.turns * (args.answer_tokens + TEMPLATE_TOKENS)
        for s, u in zip(systems, users)
    )


async def _agent(
    client, served: Served, system: str, users: list[str], answer_tokens: int, think_s: float
) -> list[Stream]:
    messages = [{"role": "system", "content": system}]
    streams = []
    for turn, user in enumerate(users):
        if turn:
            await asyncio.sleep(think_s)  # a tool call, or a person reading the answer
        messages.append({"role": "user", "content": user})
        s = await one_http(client, served.chat_url, served.make_body(messages, answer_tokens))
        streams.append(s)
        if s.error:  # the conversation cannot go on without the answer
            break
        messages.append({"role": "assistant", "content": s.text})
    return streams


async def _multiturn(served: Served, texts, args) -> tuple[float, list[list[Stream]]]:
    systems, users = texts
    async with _client(args.agents, args.timeout) as client:
        t0 = time.perf_counter()
        async with asyncio.timeout(args.timeout), asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    _agent(
                        client, served, system, user_turns, args.answer_tokens, args.think_ms / 1000
                    )
                )
                for system, user_turns in zip(systems, users)
            ]
        return time.perf_counter() - t0, [t.result() for t in tasks]


def _within_timeout(coroutine, args):
    try:
        return asyncio.run(coroutine)
    except TimeoutError:
        raise RuntimeError(
            f"the {args.workload} workload took more than --timeout {args.timeout:.0f} s"
        ) from None


def multiturn_run(served: Served, texts, args) -> dict:
    with CpuMeter() as cpu:
        wall, agents = _within_timeout(_multiturn(served, texts, args), args)
    every = [s for turns in agents for s in turns]
    ok = [s for s in every if s.error is None]
    first = [turns[0].ttft_s for turns in agents if turns and turns[0].error is None]
    later = [s.ttft_s for turns in agents for s in turns[1:] if s.error is None]
    by_turn = [
        percentile(
            [
                turns[t].ttft_s * 1000
                for turns in agents
                if len(turns) > t and turns[t].error is None
            ],
            50,
        )
        for t in range(args.turns)
    ]
    first_ms, later_ms = percentile(first, 50) * 1000, percentile(later, 50) * 1000
    return {
        "system": served.system,
        "agents": args.agents,
        "turns": args.turns,
        "first_ttft_p50_ms": first_ms,
        "later_ttft_p50_ms": later_ms,
        "later_over_first": later_ms / first_ms if first_ms else math.nan,
        "ttft_p50_ms_by_turn": by_turn,
        "wall_s": wall,
        "tokens": sum(s.tokens for s in ok),
        "longest_prompt_tokens": max((s.prompt_tokens or 0 for s in ok), default=0) or None,
        "later_cached_pct": cached_pct(
            [s for turns in agents for s in turns[1:] if s.error is None]
        ),
        "requests": len(every),
        "errors": len(every) - len(ok),
        "first_error": next((s.error for s in every if s.error), None),
        "other_cpu_pct": cpu.other_pct,
        "cores_busy": cpu.cores,
        "streams": [[asdict(s) for s in turns] for turns in agents],
    }


# ---- shared-prefix --------------------------------------------------------------------------------


def shared_prefix_texts(tokenizer, args) -> tuple[str, list[str]]:
    return bench_text.handbook(tokenizer, args.prefix_tokens), [
        bench_text.question(i) for i in range(args.requests)
    ]


async def _shared_prefix(served: Served, texts, args) -> tuple[float, list[Stream]]:
    prefix, questions = texts
    gate = asyncio.Semaphore(args.concurrency[0])

    async def one(question: str) -> Stream:
        async with (
            gate
        ):  # a closed loop: each of C clients sends its next request when the last one ends
            body = served.make_body(
                [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
                args.answer_tokens,
            )
            return await one_http(client, served.chat_url, body)

    async with _client(args.concurrency[0], args.timeout) as client:
        t0 = time.perf_counter()
        async with asyncio.timeout(args.timeout), asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(q)) for q in questions]
        return time.perf_counter() - t0, [t.result() for t in tasks]


def shared_prefix_run(served: Served, texts, args) -> dict:
    with CpuMeter() as cpu:
        wall, streams = _within_timeout(_shared_prefix(served, texts, args), args)
    ok = [s for s in streams if s.error is None]
    summary = Wave(
        served.system, args.concurrency[0], wall, streams, cpu.other_pct, cpu.cores
    ).summary()
    summary.update(
        requests=len(streams),
        prompt_tokens=max((s.prompt_tokens or 0 for s in ok), default=0) or None,
        cached_pct=cached_pct(ok),
        streams=[asdict(s) for s in streams],
    )
    return summary


# ---- running a workload on every system -----------------------------------------------------------


def prepare(args):
    """The workload's texts (built once, the same for every system) and the longest request in tokens."""
    tokenizer = bench_models.tokenizer_from(args.tokenizer)
    if args.workload == "multiturn":
        texts = multiturn_texts(tokenizer, args)
        longest = longest_multiturn(tokenizer, texts, args)
    else:
        texts = shared_prefix_texts(tokenizer, args)
        longest = (
            len(tokenizer.encode(texts[0], add_special_tokens=False))
            + 2 * TEMPLATE_TOKENS
            + max(len(tokenizer.encode(q, add_special_tokens=False)) for q in texts[1])
            + args.answer_tokens
        )
    if longest > args.max_model_len:
        raise SystemExit(
            f"the longest request needs about {longest} tokens, more than --max-model-len "
            f"{args.max_model_len}: raise it, or shorten the workload"
        )
    warm = [
        {"role": "system", "content": bench_text.warm_up(tokenizer, 500)},
        {"role": "user", "content": "Say hello."},
    ]
    return texts, longest, warm


def run(args, workdir: Path, failures: dict[str, str], skipped: dict[str, str]) -> list[dict]:
    """The workload on every chosen system, one after another: the summaries. A system that fails
    goes into `failures`, a peer that could not be installed or started into `skipped`; the rest run."""
    texts, longest, warm = prepare(args)
    args.stream_tokens = (
        longest  # transformers serve's KV blocks: the concurrent streams at their longest
    )
    log(
        f"{args.workload}: the longest request is about {longest} tokens; max_model_len {args.max_model_len}"
    )
    # with --nodes, the one node is the hit rate's reference: it gets the whole fleet's KV cache
    single_kv = args.kv_cache_mb * args.nodes if args.kv_cache_mb else None
    servers = http_servers(args, workdir, peers_folder(args, failures), single_kv)
    measure = multiturn_run if args.workload == "multiturn" else shared_prefix_run
    results = []

    def use(served: Served) -> None:
        warm_up(served, args.timeout)
        warm_up(served, args.timeout, warm)  # a long prefill, sharing nothing with the workload
        before = served.spec() if served.spec else None
        log(f"{served.system}: {args.workload}")
        result = measure(served, texts, args)
        if served.spec:
            result.update(spec_delta(before, served.spec()))
        if served.routing:
            result.update(served.routing())
        results.append(result)
        log(f"{served.system}: {_short(result)}")

    each_served(args.systems, servers, use, failures, skipped)
    if args.workload == "multiturn" and args.kv_disk_restart:
        try:
            results.append(restart_run(args, workdir, texts, warm))
        except Exception as exc:
            failures["disk restart"] = f"{type(exc).__name__}: {exc}"
    return results


def restart_run(args, workdir: Path, texts, warm: list[dict]) -> dict:
    """The first agent's system prompt with its first question on a fresh node whose KV disk tier is
    empty (cold), then with its second question on a node restarted on the same disk (warm): its
    TTFT each time, and the prompt tokens the warm one found cached (issue 52)."""
    systems, users = texts
    folder = workdir / "kv-disk"
    shutil.rmtree(folder, ignore_errors=True)
    streams = {}
    for phase, question in (("cold", users[0][0]), ("warm", users[0][1 % len(users[0])])):
        with cortex_gateway(
            args, workdir, system=f"gateway disk {phase}", kv_disk_dir=folder
        ) as served:
            warm_up(served, args.timeout)
            warm_up(served, args.timeout, warm)
            messages = [
                {"role": "system", "content": systems[0]},
                {"role": "user", "content": question},
            ]
            streams[phase] = request(served, messages, args.answer_tokens, args.timeout)
            if streams[phase].error:
                raise RuntimeError(f"the {phase} request failed: {streams[phase].error}")
    cold, warm_stream = streams["cold"], streams["warm"]
    result = {
        "system": "gateway disk restart",
        "restart": True,
        "cold_ttft_ms": cold.ttft_s * 1000,
        "warm_ttft_ms": warm_stream.ttft_s * 1000,
        "warm_over_cold": warm_stream.ttft_s / cold.ttft_s,
        "prompt_tokens": warm_stream.prompt_tokens,
        "cached_tokens": warm_stream.cached_tokens,
        "streams": [asdict(cold), asdict(warm_stream)],
    }
    log(
        f"disk restart: TTFT cold {result['cold_ttft_ms']:.0f} ms, after a restart "
        f"{result['warm_ttft_ms']:.0f} ms ({result['warm_over_cold']:.2f}x; {result['cached_tokens']} "
        f"of {result['prompt_tokens']} prompt tokens cached)"
    )
    return result


def _short(r: dict) -> str:
    if "first_ttft_p50_ms" in r:
        text = (
            f"first-turn TTFT p50 {fmt(r['first_ttft_p50_ms'], 0)} ms, "
            f"later turns {fmt(r['later_ttft_p50_ms'], 0)} ms, wall {r['wall_s']:.1f} s"
        )
    else:
        text = (
            f"TTFT p50 {fmt(r['ttft_p50_ms'], 0)} ms, p95 {fmt(r['ttft_p95_ms'], 0)} ms, "
            f"{fmt(r['aggregate_tok_s'], 1)} tok/s, wall {r['wall_s']:.1f} s"
        )
    if "acceptance" in r:
        text += (
            f", {fmt(r['draft_tokens'], 0)} draft tokens, {fmt(100 * r['acceptance'], 0)}% accepted"
        )
    return (
        text
        + f", other processes {fmt(r['other_cpu_pct'], 0)}% CPU"
        + (f", {r['errors']} errors: {r['first_error']}" if r["errors"] else "")
    )


# ---- report -------------------------------------------------------------------------------------


RATIOS = {  # (metric, what it is, better): each peer's against Cortex's gateway, from the same run
    "multiturn": [
        ("first_ttft_p50_ms", "first-turn TTFT p50", "lower"),
        ("later_ttft_p50_ms", "later-turn TTFT p50", "lower"),
        ("wall_s", "wall time", "lower"),
    ],
    "shared-prefix": [
        ("ttft_p50_ms", "TTFT p50", "lower"),
        ("ttft_p95_ms", "TTFT p95", "lower"),
        ("aggregate_tok_s", "aggregate tok/s", "higher"),
        ("wall_s", "wall time", "lower"),
    ],
}


FLEET_RATIOS = {  # (metric, what it is, better, the denominator, target): routing on's, same run (issue 20)
    "multiturn": [
        (
            "later_cached_pct",
            "cached % of later turns: routing on / one node",
            "higher",
            "gateway",
            0.9,
        ),
        ("later_ttft_p50_ms", "later-turn TTFT p50: routing on / off", "lower", "routing-off", 0.5),
        (
            "first_ttft_p50_ms",
            "first-turn TTFT p50: routing on / off",
            "lower",
            "routing-off",
            None,
        ),
        ("wall_s", "wall time: routing on / off", "lower", "routing-off", None),
    ],
    "shared-prefix": [
        ("cached_pct", "cached %: routing on / one node", "higher", "gateway", 0.9),
        ("ttft_p50_ms", "TTFT p50: routing on / off", "lower", "routing-off", None),
        ("aggregate_tok_s", "aggregate tok/s: routing on / off", "higher", "routing-off", None),
        ("wall_s", "wall time: routing on / off", "lower", "routing-off", None),
    ],
}


HOST_RATIOS = {  # (metric, what it is, better, target): the host tier's against the gateway's, same run
    "multiturn": [
        ("later_ttft_p50_ms", "later-turn TTFT p50: host tier / off", "lower", 0.3),
        ("later_cached_pct", "cached % of later turns: host tier / off", "higher", None),
        ("wall_s", "wall time: host tier / off", "lower", None),
    ],
    "shared-prefix": [
        ("ttft_p50_ms", "TTFT p50: host tier / off", "lower", None),
        ("cached_pct", "cached %: host tier / off", "higher", None),
    ],
}


def ratios(workload: str, results: list[dict]) -> list[dict]:
    by = {r["system"]: r for r in results if not r.get("restart") and r["tokens"]}
    out = []

    def ratio(
        name: str, metric: str, numerator: str, denominator: str, better: str, target: float | None
    ) -> None:
        if numerator in by and denominator in by and by[denominator][metric]:
            value = by[numerator][metric] / by[denominator][metric]
            if not math.isnan(value):
                out.append(
                    {
                        "name": name,
                        "metric": metric,
                        "numerator": numerator,
                        "denominator": denominator,
                        "value": value,
                        "better": better,
                        "target": target,
                        "noisy": any(
                            by[x]["other_cpu_pct"] > NOISY_PCT for x in (numerator, denominator)
                        ),
                    }
                )

    for r in results:
        if r.get("restart"):
            out.append(
                {
                    "name": "TTFT after a restart with a warm KV disk tier / cold",
                    "metric": "warm_ttft_ms",
                    "numerator": r["system"],
                    "denominator": r["system"],
                    "value": r["warm_over_cold"],
                    "better": "lower",
                    "target": 0.3,
                    "noisy": False,
                }
            )

    for metric, what, better, denominator, target in FLEET_RATIOS[workload]:
        ratio(what, metric, "routing-on", denominator, better, target)
    for metric, what, better, target in HOST_RATIOS[workload]:
        ratio(what, metric, HOST_TIER, "gateway", better, target)
    for peer in (p for p in NAMES if p not in ("gateway", *FLEET)):
        for metric, what, better in RATIOS[workload]:
            ratio(f"{what}: gateway / {NAMES[peer]}", metric, "gateway", peer, better, None)
    for system in (speculating("gateway", setting) for setting in SPECULATIVE[1:]):
        for metric, what, better in RATIOS[workload]:
            ratio(
                f"{what}: {label(NAMES, system)} / {NAMES['gateway']}",
                metric,
                system,
                "gateway",
                better,
                None,
            )
    return out


def describe(args) -> str:
    if args.workload == "multiturn":
        return (
            f"{args.agents} agents × {args.turns} turns, ~{args.system_tokens}-token system prompts, "
            f"~{args.user_tokens} new user tokens a turn, {args.answer_tokens}-token answers"
            + (f", {args.think_ms:g} ms between turns" if args.think_ms else "")
        )
    return (
        f"{args.requests} requests, {args.concurrency[0]} at a time, sharing a ~{args.prefix_tokens}-token "
        f"prefix, {args.answer_tokens}-token answers"
    )


def title(args, meta: dict) -> str:
    fleet = f"; fleets of {args.nodes} nodes, {args.slots} slots each" if args.nodes > 1 else ""
    return (
        f"{args.workload}: {describe(args)}; {meta['model']} {meta['dtype']}, greedy, {meta['cpu_count']} CPUs "
        f"({meta['device']}){fleet}"
    )


def print_report(args, everything: list[dict], rat: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    results = [r for r in everything if not r.get("restart")]
    console = Console(width=140)
    table = Table(title=title(args, meta))
    if args.workload == "multiturn":
        columns = [
            ("first-turn TTFT p50 ms", "first_ttft_p50_ms", 0),
            ("later-turn TTFT p50 ms", "later_ttft_p50_ms", 0),
            ("later / first", "later_over_first", 2),
            ("wall s", "wall_s", 1),
            ("longest prompt", None, 0),
            ("cached % (later)", "later_cached_pct", 0),
        ]
    else:
        columns = [
            ("TTFT p50 ms", "ttft_p50_ms", 0),
            ("TTFT p95 ms", "ttft_p95_ms", 0),
            ("aggregate tok/s", "aggregate_tok_s", 1),
            ("wall s", "wall_s", 1),
            ("prompt", None, 0),
            ("cached %", "cached_pct", 0),
        ]
    table.add_column("system", no_wrap=True)
    for name, _, _ in columns + [
        ("tokens", None, 0),
        ("other CPU %", None, 0),
        ("errors", None, 0),
    ]:
        table.add_column(name, justify="right")
    for r in results:
        prompt = r.get("longest_prompt_tokens", r.get("prompt_tokens"))
        cells = [
            str(prompt or "—") if key is None else fmt(r[key], digits) for _, key, digits in columns
        ]
        table.add_row(
            label(NAMES, r["system"]),
            *cells,
            str(r["tokens"]),
            fmt(r["other_cpu_pct"], 0),
            f"{r['errors']}/{r['requests']}" if r["errors"] else "",
        )
    console.print(table)
    if args.workload == "multiturn":
        for r in results:
            console.print(
                f"  {label(NAMES, r['system'])}: TTFT p50 by turn (ms) "
                + " / ".join(fmt(v, 0) for v in r["ttft_p50_ms_by_turn"])
            )
    for r in results:
        if "acceptance" in r:  # a speculating gateway
            console.print(
                f"  {label(NAMES, r['system'])}: {fmt(r['draft_tokens'], 0)} draft tokens checked during the "
                f"workload, {fmt(100 * r['acceptance'], 0)}% accepted"
            )
    for r in results:
        if r["system"] in FLEET:
            console.print(
                f"  {NAMES[r['system']]}: jobs routed "
                + (", ".join(f"{k} {v}" for k, v in sorted(r["routed"].items())) or "none")
                + f"; the fleet's prefix hit rate {fmt(r['prefix_hit_rate'], 2)}"
            )
    for r in everything:
        if r.get("restart"):
            console.print(
                f"  KV disk tier: TTFT on a fresh node {fmt(r['cold_ttft_ms'], 0)} ms, after a restart "
                f"{fmt(r['warm_ttft_ms'], 0)} ms ({r['cached_tokens']} of {r['prompt_tokens']} prompt "
                "tokens cached)"
            )
    for r in results:
        console.print(
            f"  {label(NAMES, r['system'])} cores busy: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["cores_busy"].items())
        )
    if any(r["other_cpu_pct"] > NOISY_PCT for r in results):
        console.print(
            f"[yellow]other processes used more than {NOISY_PCT}% of the CPU during some runs: their figures "
            "are noisy; compare ratios, or rerun on a quiet machine[/yellow]"
        )
    if rat:
        console.print(
            "Ratios, same run (times: below 1 is the first faster; tok/s and cached %: above 1):"
        )
        rt = Table()
        for col, justify in [
            ("ratio", "left"),
            ("value", "right"),
            ("target", "right"),
            ("", "left"),
        ]:
            rt.add_column(col, justify=justify)
        for r in rat:
            target, mark = verdict(r)
            rt.add_row(
                r["name"], f"{r['value']:.2f}", target, mark + (" (noisy)" if r["noisy"] else "")
            )
        console.print(rt)
    for r in results:
        if r["errors"]:
            console.print(
                f"[red]{r['system']}: {r['errors']} failed requests; first: {r['first_error']}[/red]"
            )
