"""A GGUF file's header is read with bounds (shared/gguf_parse.py): a count, length or offset that
points past the end of the file is a clear error naming the file and what is wrong, at once, where
the `gguf` package's reader loops with growing memory. Valid files read as that reader reads them."""

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from shared import gguf_header, memory
from shared.catalog import ModelProfile
from shared.model_files import ModelLoadError
from tests import gguf_files
from tests.gguf_files import ARRAY, ENDLESS, STRING
from tests.gguf_files import gguf_bytes as _file
from tests.gguf_files import gguf_kv_string as _kv_str
from tests.gguf_files import gguf_string as _str
from tests.gguf_files import gguf_tensor_info as _tensor

ARCH = _kv_str("general.architecture", "llama")
GOOD_TENSOR = _tensor("output_norm.weight", (8,), int(T.F32), 0)
F32_DATA = np.arange(8, dtype=np.float32).tobytes()

HOSTILE = {
    "an array count past the end": [
        ARCH,
        _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 62) + _str("a"),
    ],
    "a numeric array's count past the end": [
        ARCH,
        _str("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, 6, 1 << 40),
    ],
    "a string length past the end": [ARCH, _str("general.name", 1 << 50) + b"abc"],
    "a key length past the end": [ARCH, _str("x", 1 << 63)],
    "an unknown value type": [ARCH, _str("general.x") + struct.pack("<I", 99)],
    "arrays nested without end": [
        ARCH,
        _str("general.x") + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * 2000,
    ],
}


def _hostile_files() -> dict[str, bytes]:
    files = {why: _file(kvs, [GOOD_TENSOR], F32_DATA) for why, kvs in HOSTILE.items()} | {
        "a tensor count past the end": _file([ARCH], [GOOD_TENSOR], F32_DATA, counts=(1 << 60, 1)),
        "a field count past the end": _file([ARCH], [GOOD_TENSOR], F32_DATA, counts=(1, 1 << 60)),
        "a tensor's data past the end": _file(
            [ARCH], [_tensor("output_norm.weight", (8,), int(T.F32), 1 << 40)], F32_DATA
        ),
        "a tensor's data overlapping the end": _file([ARCH], [GOOD_TENSOR], F32_DATA[:16]),
        "too many dimensions": _file([ARCH], [_tensor("t", (1,) * 100, int(T.F32), 0)], F32_DATA),
        "dimensions whose product overflows": _file(
            [ARCH], [_tensor("t", (1 << 40, 1 << 40), int(T.F32), 0)], F32_DATA
        ),
        "an unknown tensor type": _file([ARCH], [_tensor("t", (8,), 999, 0)], F32_DATA),
        "a truncated file": _file([ARCH], [GOOD_TENSOR], F32_DATA)[:30],
        "not a GGUF file": b"GGML" + b"\0" * 60,
        "an array count past the end of a file without tensors": ENDLESS,
    }
    return files


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("CORTEX_CONVERT_CACHE", str(tmp_path / "cache"))
    gguf_header._parse.cache_clear()
    yield
    gguf_header._parse.cache_clear()


def test_the_hand_made_valid_file_reads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_file([ARCH], [GOOD_TENSOR], F32_DATA))
    header = gguf_header.read(path)
    assert header.architecture == "llama" and header.tensors[0].n_bytes == 32


@pytest.mark.timeout(5)  # the `gguf` package's reader loops past this, its memory growing
@pytest.mark.parametrize("why", sorted(_hostile_files()))
def test_a_hostile_header_is_a_clear_error_at_once(tmp_path, why):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_hostile_files()[why])
    with pytest.raises(ModelLoadError) as raised:  # a load error, as the replica reports it
        gguf_header.read(path)
    assert str(path) in str(raised.value) and "GGUF" in str(raised.value)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_a_valid_file_reads_as_the_gguf_package_reads_it(tmp_path, qtype):
    path = gguf_files.tiny_llama(tmp_path, qtype)
    header = gguf_header.read(path)
    reader = GGUFReader(path)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.gguf_type == theirs.tensor_type.name
        assert (ours.elements, ours.n_bytes, ours.data_offset) == (
            theirs.n_elements,
            theirs.n_bytes,
            theirs.data_offset,
        )
        assert (ours.data_dtype, ours.data_shape) == (theirs.data.dtype.str, theirs.data.shape)
    assert header.vocab_size == reader.fields["llama.vocab_size"].parts[-1][0]
    scalars = {
        name: f.parts[-1][0].item()
        for name, f in reader.fields.items()
        if len(f.types) == 1 and f.types[0].name not in ("STRING", "ARRAY")
    }
    assert header.numbers == scalars


@pytest.mark.timeout(5)
def test_the_placement_estimate_of_a_hostile_file_is_a_load_error(tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(ENDLESS)
    profile = ModelProfile(id="h", source=str(path), slots=1, max_model_len=64)
    with pytest.raises(ModelLoadError, match="general.x: 1099511627776 items"):
        memory.estimate_mb(profile)  # the gateway's placement answers this with a 503
