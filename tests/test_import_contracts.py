"""The import rules, checked by import-linter with the contracts in pyproject.toml: gateway and
node_agent never import each other; shared imports neither. The same contracts are shown to bite
on a tree that breaks them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_tree_keeps_the_import_contracts():
    done = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_the_contracts_catch_shared_importing_the_gateway(tmp_path: Path):
    for package, source in {"gateway": "", "node_agent": "", "shared": "import gateway.server\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "server.py").write_text(source)
    (tmp_path / "node_agent" / "agent.py").write_text("from gateway import server\n")

    done = lint_imports(tmp_path, ROOT / "pyproject.toml")

    assert done.returncode == 1 and "Contracts: 0 kept, 2 broken." in done.stdout, done.stdout
