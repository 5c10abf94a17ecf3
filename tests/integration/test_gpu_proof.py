"""`scripts/gpu-proof --dry-run`: the GPU proof's stages on CPU with tiny shapes, so that the one
command a GPU host gets is known to run end to end before a GPU is lent (the GPU tier skips here,
saying why; the benchmarks run a tiny random model for a few tokens)."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_stage_and_writes_one_table(tmp_path):
    out = tmp_path / "proof"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-proof"), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (out / "gpu-proof.md").read_text()
    for stage in ("tests", "streams", "multiturn", "speculation", "quant"):
        assert f"| {stage} | ok |" in table, table
    assert "no CUDA device here" in table  # the GPU tier said why it skipped
    assert "| 2 | gateway |" in table and "| gateway |" in table.split("## Multiturn")[1]
    assert (
        "| 2 | engine int4 |" in table.split("## Quantized")[1]
    )  # each quant's row, with its memory
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "gpu-proof.md",
            "streams.json",
            "multiturn.json",
            "speculation.json",
            "quant.json",
            "logs.tar.gz",
        ]
    )  # a GPU host gives back 8
