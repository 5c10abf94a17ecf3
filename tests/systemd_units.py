"""The systemd units under packaging/systemd, read as systemd reads them, for the packaging tests
(tests/unit/packaging, tests/integration/packaging): their settings in file order (an empty value
resets a list, as `ExecStart=` does in a drop-in), specifiers (%i, %H, %%) filled in, and the
environment a unit gives its process (Environment=, then EnvironmentFile= over it)."""

import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
UNITS_DIR = PACKAGING / "systemd"
SERVICES = ["cortex-gateway.service", "cortex-node@.service", "cortex-batch.service"]
REDIS_DROP_IN = UNITS_DIR / "redis-cortex.conf"


def instance_name(service: str, instance: str = "t1") -> str:
    """`cortex-node@.service` -> `cortex-node@t1.service`; other names as they are."""
    return service.replace("@.", f"@{instance}.")


@dataclass
class Unit:
    path: Path
    entries: list[tuple[str, str, str]]  # (section, key, value), specifiers filled in

    def values(self, key: str, section: str = "Service") -> list[str]:
        found: list[str] = []
        for entry_section, entry_key, value in self.entries:
            if (entry_section, entry_key) == (section, key):
                found = found + [value] if value else []
        return found

    def value(self, key: str, section: str = "Service") -> str | None:
        found = self.values(key, section)
        return found[-1] if found else None

    def exec_start(self) -> list[str]:
        return shlex.split(self.value("ExecStart") or "")

    def environment(self, read_file=lambda path: Path(path).read_text()) -> dict[str, str]:
        """Environment= assignments, then each EnvironmentFile= over them (a leading `-`: it may
        be missing); `read_file` reads one (tests point /etc/cortex at a folder of their own)."""
        env: dict[str, str] = {}
        for line in self.values("Environment"):
            env |= dict(word.split("=", 1) for word in shlex.split(line))
        for name in self.values("EnvironmentFile"):
            optional, path = name.startswith("-"), name.removeprefix("-")
            try:
                text = read_file(path)
            except FileNotFoundError:
                if optional:
                    continue
                raise
            env |= environment_file(text)
        return env


def environment_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd reads them (src/basic/env-file.c; escapes left out): comments and
    blank lines skipped; quotes count only where a value starts (`CORTEX_MODELS=["a"]` keeps its
    quotes, `KEY="a b"` loses them); trailing blanks dropped."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, value = (part.strip() for part in line.split("=", 1))
            if value[:1] in ("'", '"'):
                value = value[1 : value.index(value[0], 1)]
            env[key] = value
    return env


def load(path: Path, instance: str = "") -> Unit:
    """The unit at `path`, its specifiers filled in for `instance` on this host."""
    specifiers = {"%i": instance, "%H": socket.gethostname(), "%%": "%"}
    entries, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        for specifier, meaning in specifiers.items():
            value = value.replace(specifier, meaning)
        entries.append((section, key, value))
    return Unit(path, entries)
