"""The import rules, checked by import-linter with the contracts in pyproject.toml: gateway and
node_agent never import each other; shared imports neither; inside the gateway, the clients (CLI,
batch worker) over http over jobs over the bus and the fleet over the stores over the dialects, and
its top-level modules import none of those; inside node_agent, serving drives the engine and tensor
parallelism, which drive the model side, never the other way, and of the model side imports only
the loader and device discovery. The same contracts are shown to bite on a tree that breaks them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MODEL_MODULES = [
    p.stem for p in (ROOT / "node_agent" / "model").glob("*.py") if p.stem != "__init__"
]


def lint_imports(cwd: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
    )


def test_the_tree_keeps_the_import_contracts():
    done = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 6 kept, 0 broken." in done.stdout


def test_the_contracts_catch_imports_against_the_rules(tmp_path: Path):
    modules = {
        "gateway/http/server.py": "",
        "gateway/cli/main.py": "",
        "gateway/batch/worker.py": "",
        "gateway/jobs/job.py": "",
        "gateway/bus/router.py": "",
        "gateway/fleet/placement.py": "import gateway.jobs.job\n",
        "gateway/stores/files.py": "",
        "gateway/dialects/gather.py": "",
        "gateway/metrics.py": "import gateway.http.server\n",
        "gateway/tracing.py": "",
        "shared/server.py": "import gateway.http.server\n",
        "node_agent/agent.py": "from gateway.http import server\n",
        "node_agent/serving/agent.py": "import node_agent.model.runner\n",
        "node_agent/engine/engine.py": "",
        "node_agent/tp/channel.py": "",
        "node_agent/model/forward.py": "import node_agent.engine.engine\n",
    }
    modules |= {f"node_agent/model/{name}.py": "" for name in MODEL_MODULES if name != "forward"}
    for path, source in modules.items():
        for package in reversed(Path(path).parents):
            if package.name:
                (tmp_path / package).mkdir(exist_ok=True)
                (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / path).write_text(source)

    done = lint_imports(tmp_path, ROOT / "pyproject.toml")

    assert done.returncode == 1 and "Contracts: 0 kept, 6 broken." in done.stdout, done.stdout
