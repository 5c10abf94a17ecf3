"""The compile cache (`compile_cache`, node_agent/model/compiled_step.py) holds code Inductor loads and
runs: a folder another user owns, or that others may write to, is refused with a warning (the step
decodes eagerly), never loaded from."""

import logging
import os
import types

import pytest
import torch

from node_agent.model import compiled_step


@pytest.fixture
def compiles(monkeypatch):
    """The load compiles a stub (no model): records the cache folder Inductor would use."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled_step, "why_not", lambda model, cache: None)
    used = []

    class Stub:
        def _padded(self, *args):
            used.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))

    monkeypatch.setattr(compiled_step, "CompiledStep", Stub)
    cache = types.SimpleNamespace(device=torch.device("cpu"), scratch_position=0, block_size=16)
    return lambda folder: (compiled_step.load(None, cache, folder), used)


def test_a_cache_folder_of_this_user_only_is_used(tmp_path, compiles):
    folder = tmp_path / "compiled"
    step, used = compiles(folder)
    assert step is not None and used == [str(folder / "inductor")]
    assert (folder / "inductor").stat().st_mode & 0o077 == 0  # made for this user alone


@pytest.mark.parametrize("where", ["folder", "inductor"])
@pytest.mark.parametrize("how", ["writable by others", "writable by its group", "another owner"])
def test_a_cache_folder_others_could_have_written_is_refused(
    tmp_path, compiles, caplog, where, how
):
    folder = tmp_path / "compiled"
    (folder / "inductor").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    target = folder if where == "folder" else folder / "inductor"
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(target, os.getuid() + 4242, -1)
    else:
        target.chmod(0o777 if how == "writable by others" else 0o770)
    with caplog.at_level(logging.WARNING):
        step, used = compiles(folder)
    assert step is None and used == []  # eager: nothing compiled, nothing loaded
    assert str(target) in caplog.text and ("writable" in caplog.text or "owned" in caplog.text)
