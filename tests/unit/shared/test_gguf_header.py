"""A GGUF file's header (shared/gguf_header.py) is parsed once: the record placement and the loader
share comes from the `gguf` reader the first time, from memory after that, and, for a file with a
real vocabulary, from the JSON kept in the convert cache in the next process; a changed file is
read again."""

import os

import pytest
from gguf import GGMLQuantizationType as T

from shared import gguf_header
from tests import gguf_files


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEX_CONVERT_CACHE", str(tmp_path / "cache"))
    gguf_header._parse.cache_clear()
    yield gguf_files.tiny_llama(tmp_path, T.Q4_0)
    gguf_header._parse.cache_clear()


def reader_refused(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} parsed again")

    monkeypatch.setattr(gguf_header, "_read_file", refuse)


def test_the_header_says_what_the_file_holds_and_is_parsed_once(gguf_file, monkeypatch):
    header = gguf_header.read(gguf_file)
    assert (
        header.architecture == "llama"
        and header.number("block_count") == 2
        and header.vocab_size > 0
    )
    q = next(t for t in header.tensors if t.name == "blk.0.attn_q.weight")
    assert q.gguf_type == "Q4_0" and q.shape == (64, 64) and q.n_bytes == 64 * 64 // 32 * 18
    reader_refused(monkeypatch)
    assert gguf_header.read(gguf_file) is header  # this process: from memory
    assert not (
        gguf_file.parent / "cache" / "gguf-headers"
    ).exists()  # a small vocabulary is not kept


def test_a_kept_header_serves_the_next_process_and_a_changed_file_is_read_again(
    gguf_file, monkeypatch
):
    monkeypatch.setattr(gguf_header, "KEEP_VOCAB", 0)
    first = gguf_header.read(gguf_file)
    assert len(list((gguf_file.parent / "cache" / "gguf-headers").glob("*.json"))) == 1
    gguf_header._parse.cache_clear()  # as a new process
    with monkeypatch.context() as m:
        reader_refused(m)
        assert gguf_header.read(gguf_file) == first
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with monkeypatch.context() as m:
        reader_refused(m)
        with pytest.raises(AssertionError, match="parsed again"):
            gguf_header.read(gguf_file)
