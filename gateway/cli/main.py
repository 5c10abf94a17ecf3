"""The `cortex` command: start the parts (`up`, `gateway`, `node`, `batch-worker`: each a process,
`python -m …`), look at the fleet (`status`), steer it (`models`, `drain`) and manage API keys (`keys`).

    cortex up                      # redis-server + gateway + batch worker + one node agent, in the foreground
    cortex gateway --port 31313    # one gateway replica
    cortex node --models SmolLM2-135M-Instruct
    cortex batch-worker            # an arq worker running batches (as many as you like)
    cortex status [--json]         # nodes, devices, memory, models, slots, queues (from Redis)
    cortex keys create --name NAME # API keys: create | list | show | revoke (in Redis)
    cortex backup PATH             # a snapshot of Redis (keys, files, batches, responses) copied to PATH

Flags override settings; everything else comes from `CORTEX_*` variables and the TOML file named
by `CORTEX_CONFIG` (see `shared/settings.py`). Verbs that read Redis find the stack `cortex up`
started when no Redis is named (gateway/cli/run_file.py). Nothing here imports the node agent:
`cortex node` runs `python -m node_agent`, so `cortex status` starts fast and needs no torch.
"""

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError

from gateway.cli import backup, pull_progress
from gateway.cli.embedded_redis import default_data_dir
from gateway.cli.run_file import settings_for_cli
from gateway.cli.status import key_summary, render_fleet, render_keys
from gateway.cli.up import UP_REDIS_PORT, run_up
from gateway.fleet import operations
from gateway.fleet.placement import Placer
from shared import redis_health
from shared.api_keys import KeySpec, KeyStore
from shared.catalog import Catalog
from shared.errors import CortexError
from shared.fleet import Fleet
from shared.redis_conn import connect, is_cluster_url, redact
from shared.settings import GatewaySettings, NodeSettings

CLI_NAME = "cortex"


def _overrides(args: argparse.Namespace, **names: str) -> dict[str, Any]:
    """Settings keyword arguments for the flags that were given (None means not given)."""
    return {
        setting: getattr(args, flag)
        for setting, flag in names.items()
        if getattr(args, flag, None) is not None
    }


def _apply_common(args: argparse.Namespace) -> None:
    if getattr(args, "config", None):
        os.environ["CORTEX_CONFIG"] = str(args.config)
    if getattr(args, "redis_url", None):
        os.environ["CORTEX_REDIS_URL"] = args.redis_url


def _exec_part(module: str, flags: dict[str, Any]) -> int:
    """Become `python -m module`, the flags given as its `CORTEX_*` settings."""
    for name, value in flags.items():
        os.environ[f"CORTEX_{name.upper()}"] = (
            json.dumps(value) if isinstance(value, list) else str(value)
        )
    os.execv(sys.executable, [sys.executable, "-m", module])
    return 1  # not reached


def cmd_gateway(args: argparse.Namespace) -> int:
    return _exec_part("gateway", _overrides(args, host="host", port="port"))


def cmd_node(args: argparse.Namespace) -> int:
    return _exec_part(
        "node_agent", _overrides(args, models="models", node_name="node_name", device="device")
    )


def cmd_batch_worker(args: argparse.Namespace) -> int:
    return _exec_part("gateway.batch", {})


def cmd_up(args: argparse.Namespace) -> int:
    gateway_settings = GatewaySettings(**_overrides(args, host="host", port="port"))
    return run_up(args, gateway_settings, NodeSettings(**_overrides(args, models="models")))


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_for_cli()
    try:
        fleet = asyncio.run(_read_fleet(settings))
    except (redis.RedisError, OSError) as exc:
        print(
            f"cortex status: cannot read Redis at {redact(settings.redis_url)}: {exc}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(fleet.model_dump_json(indent=2))
    else:
        render_fleet(fleet)
    return 0


async def _read_fleet(settings: GatewaySettings):
    client = connect(settings.redis_url)
    try:
        fleet = await Fleet(client, settings.keys, settings.node_ttl_s).status()
        try:
            fleet.redis = await redis_health.inspect(client)
        except redis.ResponseError as exc:  # INFO not allowed (an ACL): the fleet table still helps
            print(f"cortex status: cannot read how Redis keeps its data: {exc}", file=sys.stderr)
        return fleet
    finally:
        await client.aclose()


def cmd_backup(args: argparse.Namespace) -> int:
    settings = settings_for_cli()
    return asyncio.run(_backup(settings, Path(args.path)))


async def _backup(settings: GatewaySettings, path: Path) -> int:
    if is_cluster_url(
        settings.redis_url
    ):  # one snapshot file holds one node's slots, not the cluster
        print(
            "cortex backup: CORTEX_REDIS_URL names a Redis Cluster; back up each master's snapshot instead "
            "(redis-cli --cluster call HOST:PORT BGSAVE, then copy each master's dump.rdb)",
            file=sys.stderr,
        )
        return 2
    client = connect(settings.redis_url)
    try:
        size = await backup.backup(client, path)
    except (backup.BackupFailed, redis.RedisError, OSError) as exc:
        print(f"cortex backup: {exc}", file=sys.stderr)
        return 2
    finally:
        await client.aclose()
    print(
        f"wrote {path} ({size} bytes): a snapshot of every key. To restore it, stop the stack, put it in place of "
        "dump.rdb in Redis's directory and remove appendonlydir/ beside it (docs/operations.md#backup-and-restore)"
    )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    return asyncio.run(_operate(args.action, args.model, args.node, follow=not args.detach))


def cmd_drain(args: argparse.Namespace) -> int:
    return asyncio.run(_operate("drain", None, args.node))


async def _operate(action: str, model: str | None, node: str | None, follow: bool = False) -> int:
    """Run one fleet operation straight against Redis, as the admin API would (gateway/fleet/operations.py)."""
    settings = settings_for_cli()
    client = connect(settings.redis_url)
    fleet = Fleet(client, settings.keys, settings.node_ttl_s)
    placer = Placer(client, settings.keys, settings, Catalog.load(settings.models_file), fleet)
    try:
        if action == "load":
            print(f"loading {model} on {await operations.load(placer, model, node)}")
        elif action == "unload":
            print(
                f"unloading {model} from {', '.join(await operations.unload(placer, model, node)) or 'no node'}"
            )
        elif action == "pull":
            nodes = await operations.pull(placer, model)
            print(
                f"pulling {model} on {', '.join(nodes)}"
                + ("" if follow else "; `cortex status` shows the progress")
            )
            if follow:
                try:
                    return (
                        0
                        if await pull_progress.follow(
                            fleet, operations.hub_folder(placer.catalog.resolve(model)), nodes
                        )
                        else 2
                    )
                except (KeyboardInterrupt, asyncio.CancelledError):
                    print("stopped following; the nodes pull on (`cortex status` shows them)")
                    return 130
        elif action == "rm":
            asked = await operations.remove_files(placer, model, node)
            print(
                f"deleting the files of {model} on {', '.join(asked) or 'no node (none holds them)'}; a node keeps "
                "them while it has the model loaded, pinned or being pulled"
            )
        elif action in ("pin", "unpin"):
            await operations.set_pin(placer, model, action == "pin")
            print(f"{model} {action}ned")
        else:
            await operations.drain(placer, node)
            print(
                f"draining {node}: it finishes its running jobs, unloads its models and goes idle"
            )
        return 0
    except (CortexError, redis.RedisError) as exc:
        print(f"cortex {action}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    finally:
        await client.aclose()


def cmd_keys(args: argparse.Namespace) -> int:
    return asyncio.run(_keys(args))


async def _keys(args: argparse.Namespace) -> int:
    """`cortex keys create | list | show | revoke`, straight against Redis, as `/admin/keys` would."""
    settings = settings_for_cli()
    client = connect(settings.redis_url)
    store = KeyStore(client, settings.keys)
    try:
        if args.action == "create":
            spec = KeySpec(
                name=args.name,
                models=args.models or [],
                rpm=args.rpm,
                tpm=args.tpm,
                max_tokens_per_day=args.max_tokens_per_day,
                expires=args.expires,
            )
            key, secret = await store.create(spec)
            print(secret)
            print(
                f"created API key {key.name}: {key_summary(key.shown())}\nthe secret above is shown only now "
                "(Redis keeps its hash): clients send it as Authorization: Bearer or x-api-key",
                file=sys.stderr,
            )
        elif args.action == "list":
            shown = [key.shown() for key in await store.list()]
            if args.json:
                print(json.dumps(shown, indent=2))
            else:
                render_keys(shown)
        elif args.action == "show":
            shown = (await store.get(args.name)).shown()
            print(
                json.dumps(shown, indent=2)
                if args.json
                else "\n".join(f"{k}: {v}" for k, v in shown.items())
            )
        else:
            print(
                f"revoked API key {(await store.revoke(args.name)).name}: every gateway refuses it from now on"
            )
        return 0
    except ValidationError as exc:
        print(
            f"cortex keys {args.action}: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
            file=sys.stderr,
        )
    except (CortexError, redis.RedisError) as exc:
        print(f"cortex keys {args.action}: {getattr(exc, 'message', exc)}", file=sys.stderr)
    finally:
        await client.aclose()
    return 2


def _count_arg(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError("a whole number, 0 or more (0: no limit)")
    return int(value)


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"on or off, not {value!r}")
    return value == "on"


def _models_arg(value: str) -> list[str]:
    models = [m.strip() for m in value.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError("name at least one model")
    return models


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=CLI_NAME,
        description="Cortex: local LLMs served across a fleet, with Redis as the spine.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", help="TOML settings file with [gateway] and [node] tables (sets CORTEX_CONFIG)"
    )
    common.add_argument("--redis-url", help="Redis to use (sets CORTEX_REDIS_URL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("gateway", parents=[common], help="run one gateway (HTTP API)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("node", parents=[common], help="run one node agent")
    p.add_argument(
        "--models", type=_models_arg, help="comma-separated catalogue ids to load at start"
    )
    p.add_argument("--node-name")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser(
        "batch-worker", parents=[common], help="run one batch worker (arq) for /v1/batches"
    )
    p.set_defaults(func=cmd_batch_worker)

    p = sub.add_parser(
        "up",
        parents=[common],
        help="run redis-server, a gateway and a node agent together, in the foreground",
    )
    p.add_argument("--host", help="gateway host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 31313)")
    p.add_argument(
        "--models", type=_models_arg, help="comma-separated catalogue ids the node loads"
    )
    p.add_argument(
        "--redis-port",
        type=int,
        default=int(os.environ.get("CORTEX_UP_REDIS_PORT", UP_REDIS_PORT)),
        help="port of the embedded redis-server (CORTEX_UP_REDIS_PORT, default %(default)s); "
        "ignored when CORTEX_REDIS_URL is set",
    )
    p.add_argument(
        "--redis-dir",
        default=os.environ.get("CORTEX_UP_REDIS_DIR") or str(default_data_dir()),
        help="where the embedded Redis keeps its append-only file and snapshots (CORTEX_UP_REDIS_DIR, "
        "default %(default)s); one `cortex up` at a time",
    )
    p.add_argument(
        "--redis-persistence",
        type=_on_off,
        metavar="{on,off}",
        default=os.environ.get("CORTEX_UP_REDIS_PERSISTENCE", "on"),
        help="off: the embedded Redis keeps nothing across a restart, for tests "
        "(CORTEX_UP_REDIS_PERSISTENCE, default %(default)s)",
    )
    p.add_argument(
        "--stop-timeout-s",
        type=float,
        help="how long each child may take to stop before it is killed (default: the node's "
        "shutdown_grace_s + 10, 60 for Redis, 10 for the others); a second Ctrl-C kills at once",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "models",
        parents=[common],
        help="load, unload, pull (files), rm (files), pin or unpin a model across the fleet",
    )
    p.add_argument("action", choices=["load", "unload", "pull", "rm", "pin", "unpin"])
    p.add_argument("model", help="catalogue id or alias")
    p.add_argument(
        "--node",
        help="load on / unload from / rm on this node only (default: placement decides / "
        "every node)",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="pull: return at once (default: follow the progress until "
        "every node has the files; Ctrl-C stops following only)",
    )
    p.set_defaults(func=cmd_models)

    p = sub.add_parser(
        "drain",
        parents=[common],
        help="stop a node taking jobs; it finishes running ones, unloads, idles",
    )
    p.add_argument("node")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("keys", help="create, list, show or revoke API keys (in Redis)")
    keys = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    k = keys.add_parser("create", parents=[common], help="create a key; prints its secret once")
    k.add_argument(
        "--name", required=True, help="unique; names the key in logs, metrics and ownership"
    )
    k.add_argument(
        "--models", type=_models_arg, help="comma-separated catalogue ids or aliases (default: all)"
    )
    k.add_argument("--rpm", type=_count_arg, default=0, help="requests per minute (0: no limit)")
    k.add_argument(
        "--tpm",
        type=_count_arg,
        default=0,
        help="tokens (prompt + completion) per minute (0: no limit)",
    )
    k.add_argument(
        "--max-tokens-per-day", type=_count_arg, default=0, help="tokens per UTC day (0: no limit)"
    )
    k.add_argument("--expires", help="lifetime from now: 30d, 12h, 90m (default: never)")
    k = keys.add_parser("list", parents=[common], help="every key with its limits and usage")
    k.add_argument("--json", action="store_true")
    k = keys.add_parser("show", parents=[common], help="one key with its limits and usage")
    k.add_argument("name")
    k.add_argument("--json", action="store_true")
    k = keys.add_parser(
        "revoke", parents=[common], help="refuse a key from now on (its record and usage stay)"
    )
    k.add_argument("name")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser(
        "backup", parents=[common], help="snapshot Redis (BGSAVE) and copy the snapshot to PATH"
    )
    p.add_argument("path", help="where to write the snapshot (an RDB file)")
    p.set_defaults(func=cmd_backup)

    p = sub.add_parser(
        "status", parents=[common], help="show nodes, devices, models, slots and queues"
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _apply_common(args)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
