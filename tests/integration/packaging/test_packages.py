"""scripts/package builds the wheel, the RPM and the Debian package (each variant once a session,
~5 s), and they read back as the issue asks: `rpm -qlp` and `dpkg-deb -c` list the units, the CLI
and the config files; the config files are flagged as config (noreplace / conffiles); the state
folders belong to the user `cortex`; the maintainer scripts create the user, stop the units on
removal only and keep the data; the CLI on the PATH runs the wheel's `cortex` entry point; and
the CPU and CUDA packages differ only in the torch they install."""

import io
import shutil
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.systemd_units import ROOT, SERVICES

VERSION = "0.1.0"
UNITS = {f"/usr/lib/systemd/system/{unit}" for unit in SERVICES} | {
    "/usr/lib/systemd/system/redis-server.service.d/cortex.conf",
    "/usr/lib/systemd/system/redis.service.d/cortex.conf",
}
CONFIGS = {"/etc/cortex/cortex.toml", "/etc/cortex/models.toml", "/etc/cortex/redis.conf"}
STATE = {"/var/lib/cortex", "/var/lib/cortex/models", "/var/cache/cortex"}
WRAPPER = "/usr/bin/cortex"


@dataclass
class Built:
    out: Path

    def one(self, pattern: str) -> Path:
        (found,) = self.out.glob(pattern)
        return found


needs_rpm = pytest.mark.skipif(
    shutil.which("rpmbuild") is None or shutil.which("rpm") is None,
    reason="rpmbuild is not installed (scripts/setup --tests installs Debian's rpm)",
)
needs_deb = pytest.mark.skipif(
    shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed (not a Debian host)"
)


def build(out: Path, variant: str) -> Built:
    subprocess.run(
        [str(ROOT / "scripts" / "package"), "--variant", variant, "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return Built(out)


@pytest.fixture(scope="session")
def cpu(tmp_path_factory) -> Built:
    return build(tmp_path_factory.mktemp("cpu"), "cpu")


@pytest.fixture(scope="session")
def cuda(tmp_path_factory) -> Built:
    return build(tmp_path_factory.mktemp("cuda"), "cuda")


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def rpm_files(rpm: Path) -> dict[str, str]:
    """path -> its file flags (`c`: config, `n`: noreplace, `d`: doc)."""
    lines = run("rpm", "-qp", "--queryformat", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]", str(rpm))
    return dict((line.split(" ", 1) + [""])[:2] for line in lines.splitlines())


def deb_member(deb: Path, path: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(_data_tar(deb))) as tar:
        return tar.extractfile("." + path).read()


def _data_tar(deb: Path) -> bytes:
    return subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True, timeout=60
    ).stdout


@needs_rpm
@needs_deb
def test_package_builds_the_wheel_the_rpm_and_the_deb(cpu):
    assert cpu.one(f"cortex_serve-{VERSION}-py3-none-any.whl").stat().st_size > 100_000
    assert cpu.one(f"cortex-cpu-{VERSION}-1.noarch.rpm").exists()
    assert cpu.one(f"cortex-cpu_{VERSION}-1_all.deb").exists()


@needs_rpm
def test_rpm_lists_units_cli_and_config_files_flagged_noreplace(cpu):
    rpm = cpu.one("*.rpm")
    listed = run("rpm", "-qlp", str(rpm)).split()
    assert UNITS | CONFIGS | STATE | {WRAPPER, "/opt/cortex/torch.txt"} <= set(listed)
    assert f"/opt/cortex/wheels/cortex_serve-{VERSION}-py3-none-any.whl" in listed
    flags = rpm_files(rpm)
    assert {path for path, flag in flags.items() if "c" in flag} == CONFIGS
    assert all(flags[path] == "cn" for path in CONFIGS)  # %config(noreplace): kept as edited
    assert set(run("rpm", "-qcp", str(rpm)).split()) == CONFIGS


@needs_rpm
def test_rpm_state_folders_belong_to_cortex(cpu):
    owners = run(
        "rpm", "-qp", "--queryformat", "[%{FILENAMES} %{FILEUSERNAME}:%{FILEGROUPNAME}\n]",
        str(cpu.one("*.rpm")),
    )  # fmt: skip
    owner = dict(line.split() for line in owners.splitlines())
    assert {path: owner[path] for path in STATE} == dict.fromkeys(STATE, "cortex:cortex")
    assert owner[WRAPPER] == owner["/etc/cortex/cortex.toml"] == "root:root"


@needs_rpm
def test_rpm_scripts_create_the_user_and_stop_units_only_on_removal(cpu):
    scripts = run("rpm", "-qp", "--scripts", str(cpu.one("*.rpm")))
    pre = scripts.split("preinstall scriptlet")[1].split("scriptlet")[0]
    assert "useradd --system" in pre  # before the files: they belong to the user
    preun = scripts.split("preuninstall scriptlet")[1].split("scriptlet")[0]
    assert 'if [ "$1" -eq 0 ]' in preun and "systemctl stop" in preun  # 0: erase, not upgrade
    postun = scripts.split("postuninstall scriptlet")[1]
    assert "rm -rf /opt/cortex/venv" in postun and "/var/lib/cortex" not in postun.split("#")[0]
    assert "/opt/cortex/lib/make-venv" in scripts.split("postinstall scriptlet")[1]
    assert "Conflicts: cortex-cuda" not in scripts
    assert "cortex-cuda" in run("rpm", "-qp", "--conflicts", str(cpu.one("*.rpm")))


@needs_deb
def test_deb_lists_units_cli_and_conffiles(cpu):
    deb = cpu.one("*.deb")
    listed = {
        line.split()[-1].removeprefix(".").rstrip("/")
        for line in run("dpkg-deb", "-c", str(deb)).splitlines()
    }
    assert UNITS | CONFIGS | STATE | {WRAPPER, "/opt/cortex/lib/make-venv"} <= listed
    control = Path(run("mktemp", "-d").strip())
    try:
        subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True, timeout=60)
        assert set((control / "conffiles").read_text().split()) == CONFIGS
        postinst = (control / "postinst").read_text()
        assert postinst.index("useradd --system") < postinst.index("install -d -o cortex -g cortex")
        prerm = (control / "prerm").read_text()
        assert '[ "$1" = remove ]' in prerm and "systemctl stop" in prerm  # not on upgrade
        assert "rm -rf /opt/cortex/venv" in (control / "postrm").read_text()
    finally:
        shutil.rmtree(control)
    assert run("dpkg-deb", "-f", str(deb), "Package", "Conflicts").split() == [
        "Package:", "cortex-cpu", "Conflicts:", "cortex-cuda",
    ]  # fmt: skip


@needs_deb
def test_deb_units_and_config_are_the_packaging_folder_s(cpu):
    deb = cpu.one("*.deb")
    for unit in SERVICES:
        shipped = deb_member(deb, f"/usr/lib/systemd/system/{unit}")
        assert shipped == (ROOT / "packaging" / "systemd" / unit).read_bytes()
    assert (
        deb_member(deb, "/etc/cortex/cortex.toml")
        == (ROOT / "packaging" / "cortex.toml").read_bytes()
    )


@needs_deb
def test_the_cli_on_the_path_is_the_wheel_s_cortex_entry_point(cpu):
    wrapper = deb_member(cpu.one("*.deb"), WRAPPER).decode()
    assert wrapper.startswith("#!/bin/sh") and 'exec /opt/cortex/venv/bin/cortex "$@"' in wrapper
    with zipfile.ZipFile(cpu.one("*.whl")) as wheel:
        entry_points = wheel.read(f"cortex_serve-{VERSION}.dist-info/entry_points.txt").decode()
        names = wheel.namelist()
    assert "cortex = gateway.cli.main:main" in entry_points
    assert {"shared/systemd_notify.py", "gateway/static/dashboard.html"} <= set(names)


@needs_deb
def test_cpu_and_cuda_packages_differ_only_in_torch(cpu, cuda):
    cpu_tar, cuda_tar = _data_tar(cpu.one("*.deb")), _data_tar(cuda.one("*.deb"))
    with (
        tarfile.open(fileobj=io.BytesIO(cpu_tar)) as a,
        tarfile.open(fileobj=io.BytesIO(cuda_tar)) as b,
    ):
        assert a.getnames() == b.getnames()
        differ = [
            name
            for name in a.getnames()
            if a.getmember(name).isfile()
            and a.extractfile(name).read() != b.extractfile(name).read()
        ]
    assert differ == ["./opt/cortex/torch.txt"]
    cpu_torch = deb_member(cpu.one("*.deb"), "/opt/cortex/torch.txt").decode()
    assert "torch==2.13.0+cpu" in cpu_torch and "whl/cpu" in cpu_torch
    assert "+cpu" not in deb_member(cuda.one("*.deb"), "/opt/cortex/torch.txt").decode()
