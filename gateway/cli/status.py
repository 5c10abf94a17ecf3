"""What the CLI prints: the fleet (`cortex status`) and API keys (`cortex keys list`) as tables."""

import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shared.fleet_status import ROUTING_OUTCOMES, FleetStatus, ModelStatus
from shared.heartbeat import KVCacheStats, PullProgress, SpecDecodeStats
from shared.lifecycle import ModelState


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _gib(mb: int) -> str:
    return f"{mb / 1024:.1f}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part // whole}%" if whole else "-"  # floored: 100% only when all of it


def _model(name: str, m: ModelStatus) -> str:
    idle = "busy" if m.slots_used else (_age(m.idle_s) if m.idle_s is not None else "-")
    return (
        f"{name} [{_STATE_STYLE.get(m.state, 'white')}]{m.state}[/] {m.slots_used}/{m.slots_total}"
        + (f" ctx={m.max_model_len}" if m.max_model_len else "")
        + (f" weights={m.quant}:{m.weight_mb}MB" if m.quant else "")
        + f" q={m.queue_depth} idle={idle}"
        + (f" tp={len(m.devices)} on {'+'.join(m.devices)}" if len(m.devices) > 1 else "")
        + (f" ({m.error})" if m.error else "")
        + (f" {_pull(m.download)}" if m.download else "")
        + (f"\n[dim]{escape(m.kernels)}[/]" if m.kernels else "")
    )


def _pull(p: PullProgress) -> str:
    return (
        f"{_percent(p.bytes_done, p.bytes_total)} of {p.bytes_total / 1e6:.1f} MB"
        f" at {p.rate_bps / 1e6:.1f} MB/s from {p.source or '?'}"
    )


def _kv(kv: KVCacheStats, spec: SpecDecodeStats | None) -> str:
    """The KV cache's use, the prefix cache's hit rate, the tiers below the device where it has
    them (host slots in use, blocks on disk, and the share of hits each served), and the share of
    draft tokens accepted where the model speculates."""
    return (
        f"KV {_percent(kv.blocks_used, kv.blocks_total)} ({kv.blocks_used}/{kv.blocks_total} blk)"
        f" prefix {_percent(kv.prefix_hits, kv.prefix_queries)}"
        + (
            f" host {kv.host_blocks_used}/{kv.host_blocks_total} blk"
            f" ({_percent(kv.host_hits, kv.prefix_hits)} of hits)"
            if kv.host_blocks_total
            else ""
        )
        + (
            f" disk {kv.disk_blocks} blk ({_percent(kv.disk_hits, kv.prefix_hits)} of hits)"
            if kv.disk_blocks or kv.disk_hits
            else ""
        )
        + (
            f" spec {_percent(spec.accepted_tokens, spec.draft_tokens)}"
            if spec and spec.draft_tokens
            else ""
        )
    )


_STATE_STYLE = {
    ModelState.READY: "green",
    ModelState.DOWNLOADING: "cyan",
    ModelState.LOADING: "yellow",
    ModelState.SLEEPING: "blue",
    ModelState.UNLOADING: "yellow",
    ModelState.POISONED: "red",
    ModelState.FAILED: "red",
}


def render_fleet(fleet: FleetStatus, console=None) -> None:
    console = console or Console()
    if fleet.redis is not None:
        r = fleet.redis
        console.print(
            f"Redis {r.version}: {r.memory}; persistence: {r.persistence}; eviction: {r.eviction_policy}",
            soft_wrap=True,
        )
        for warning in r.warnings:
            console.print(f"[red]warning:[/] {warning}", soft_wrap=True)
    if not fleet.nodes:
        console.print("No nodes have sent a heartbeat.")
    else:
        table = Table(title="Nodes", title_justify="left")
        for column in (
            "node",
            "alive",
            "heartbeat",
            "version",
            "state",
            "devices (used/total GiB)",
            "models (slots used/total, context, queued, idle)",
            "KV cache",
        ):
            table.add_column(column)
        for n in fleet.nodes:
            devices = "\n".join(
                f"{d.id} {d.name} {_gib(d.used_mb)}/{_gib(d.total_mb)}" for d in n.devices
            )
            state = n.state if not n.error else f"{n.state}: {n.error}"
            node = [
                n.node,
                "[green]yes[/]" if n.alive else "[red]no[/]",
                f"{_age(n.heartbeat_age_s)} ago",
                n.version,
                state + (f"\n{','.join(n.labels)}" if n.labels else ""),
                devices or "-",
            ]
            # a row per model, so that its KV cache stays beside it however the lines wrap
            rows = [
                (_model(name, m), _kv(m.kv, m.spec) if m.kv is not None else "")
                for name, m in sorted(n.models.items())
            ]
            rows = rows or [("-", "")]
            for i, row in enumerate(rows):
                table.add_row(
                    *(node if i == 0 else [""] * len(node)), *row, end_section=i == len(rows) - 1
                )
        console.print(table)
    if fleet.queues:
        table = Table(title="Queues", title_justify="left")
        for column in (
            "model",
            "queued interactive",
            "queued batch",
            "running",
            "oldest wait",
            "replicas",
            "routed " + "/".join(ROUTING_OUTCOMES),
            "prefix hits",
        ):
            table.add_column(column, justify="left" if column == "model" else "right")
        for q in fleet.queues:
            oldest = _age(q.oldest_wait_s) if q.oldest_wait_s is not None else "-"
            routed = "/".join(str(q.routed.get(k, 0)) for k in ROUTING_OUTCOMES)
            hits = f"{q.prefix_hit_rate:.0%}" if q.prefix_hit_rate is not None else "-"
            table.add_row(
                q.model,
                str(q.queued.get("interactive", 0)),
                str(q.queued.get("batch", 0)),
                str(q.running),
                oldest,
                str(q.replicas),
                routed,
                hits,
            )
        console.print(table)
    if fleet.not_loaded:
        table = Table(title="Catalogue models not loaded on any live node", title_justify="left")
        for column in ("model", "state", "memory (MiB)", "pinned", "queued"):
            table.add_column(column, justify="left" if column in ("model", "state") else "right")
        for c in fleet.not_loaded:
            table.add_row(
                c.model,
                c.state,
                str(c.memory_mb) if c.memory_mb is not None else "estimated at load",
                "yes" if c.pin else "no",
                str(c.queue_depth),
            )
        console.print(table)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000)) if ms else "never"


def key_summary(k: dict) -> str:
    limit = lambda n: str(n) if n else "-"
    return (
        f"models {','.join(k['models']) or 'all'}; rpm {limit(k['rpm'])}, tpm {limit(k['tpm'])}, "
        f"tokens/day {limit(k['max_tokens_per_day'])}; expires {_when(k['expires_ms'])}"
    )


def render_keys(keys: list[dict], console=None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 160)  # pipes get whole rows
    if not keys:
        console.print(
            "No API keys: auth is off on loopback gateways. Create one with `cortex keys create --name NAME`."
        )
        return
    table = Table(title="API keys", title_justify="left")
    for column in (
        "name",
        "key",
        "state",
        "models",
        "rpm/tpm/day",
        "expires",
        "requests",
        "tokens in/out",
        "today",
        "refused",
    ):
        numeric = column in ("requests", "tokens in/out", "today", "refused")
        table.add_column(
            column, justify="right" if numeric else "left", no_wrap=column in ("name", "key")
        )
    limit = lambda n: str(n) if n else "-"
    for k in keys:
        table.add_row(
            k["name"],
            k["hint"] + "…",
            k["state"],
            ",".join(k["models"]) or "all",
            "/".join(limit(k[f]) for f in ("rpm", "tpm", "max_tokens_per_day")),
            _when(k["expires_ms"]),
            str(k["requests"]),
            f"{k['prompt_tokens']}/{k['completion_tokens']}",
            str(k["tokens_today"]),
            str(k["rejections"]),
        )
    console.print(table)
