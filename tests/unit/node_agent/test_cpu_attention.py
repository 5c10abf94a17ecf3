"""The CPU attention kernels (node_agent/model/cpu_attention.py): what the decode kernel computes equals SDPA
over the same rows' blocks copied out (GQA, sliding windows, soft-capping, float32 and bfloat16), and
so does the prefill kernel's causal chunk read from scattered blocks (float32 and bfloat16);
which models read in place; a machine that cannot build them decodes through the copy; and decode
rows packed with prefill chunks into one forward give what the separate forwards give.
The engine's greedy equality with transformers through it is the architecture matrix's
(test_architectures.py). A lock left by a killed build does not hang the next load."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node_agent.engine.engine import Engine
from node_agent.model import cpu_attention, cpu_kernels, forward, loader
from node_agent.model.kv_cache import PackedChunk
from tests.model_fixtures import tiny_profile

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason="the kernels could not be built here (see the log)"
)


def reference(q, keys, values, tables, lengths, block_size, scale, window, softcap):
    """SDPA's math over each row's visible positions, copied out of the pools position by position."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    out = []
    for row in range(q.shape[0]):
        length = int(lengths[row])
        first = max(0, length - window) if window else 0
        slots = torch.tensor(
            [
                int(tables[row, p // block_size]) * block_size + p % block_size
                for p in range(first, length)
            ]
        )
        k = keys[:, slots].float().repeat_interleave(heads // kv_heads, 0)  # [heads, n, dim]
        v = values[:, slots].float().repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", q[row].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 0.0), (0, 5.0)])
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [  # the kernel's instances: a group's heads 1-4 at a time
        (4, 4, 16),
        (9, 3, 64),
        (8, 2, 64),
        (4, 2, 64),
        (7, 1, 64),
        (8, 2, 128),
        (2, 1, 256),
        (6, 2, 24),
        (2, 1, 80),
        (4, 4, 8),
    ],
)  # and dims known only at run time, not all multiples of 16
@pytest.mark.parametrize("block_size", [4, 32])  # tiles of a whole block, and of half of one
def test_it_equals_attention_over_the_copied_blocks(
    dtype, tolerance, window, softcap, heads, kv_heads, dim, block_size
):
    torch.manual_seed(0)
    rows, max_blocks, pool_blocks = 5, 12, 64
    keys, values = (
        torch.randn(kv_heads, pool_blocks * block_size, dim).to(dtype) for _ in range(2)
    )
    tables = torch.stack([torch.randperm(pool_blocks - 1)[:max_blocks] + 1 for _ in range(rows)])
    lengths = torch.tensor(
        [1, 4, 5, 23, 48]
    )  # one position, a whole block, a block and one, blocks and some
    q = torch.randn(rows, heads, dim).to(dtype)
    got = torch.ops.cortex.paged_decode_attention(
        q, keys, values, tables, lengths, block_size, 0.3, window, softcap
    )
    want = reference(q, keys, values, tables, lengths, block_size, 0.3, window, softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 128), (8, 2, 80), (2, 1, 8)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "start, length", [(0, 1), (0, 37), (5, 1), (16, 16), (45, 20), (120, 300), (0, 200), (250, 6)]
)  # within one key tile, across several, the last one partial
def test_the_prefill_kernel_reads_a_chunk_in_place_as_sdpa_under_its_causal_mask(
    dtype, tolerance, heads, kv_heads, dim, block_size, start, length
):
    """The prefill kernel over the row's blocks, scattered in the pools as a long-running node's are
    (its scratch larger than needed, holding garbage), equals SDPA in float32 over the row's positions
    copied out with the chunk's causal mask."""
    torch.manual_seed(0)
    seen, pool_blocks, tile = start + length, 128, cpu_attention.PREFILL_TILE
    blocks = -(-seen // block_size)
    keys, values = (
        torch.randn(kv_heads, (pool_blocks + 1) * block_size, dim).to(dtype) for _ in range(2)
    )
    table = torch.zeros(pool_blocks + 4, dtype=torch.long)
    table[:blocks] = torch.randperm(pool_blocks)[:blocks] + 1
    slots = table[torch.arange(seen) // block_size] * block_size + torch.arange(seen) % block_size
    query = torch.randn(heads, length, dim).to(dtype)
    mask = torch.arange(seen)[None] <= torch.arange(start, seen)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        query[None].float(),
        keys[:, slots][None].float().repeat_interleave(heads // kv_heads, 1),
        values[:, slots][None].float().repeat_interleave(heads // kv_heads, 1),
        attn_mask=mask,
        scale=0.3,
    )
    scratch = [
        torch.full((kv_heads * (-(-seen // tile) + 1) * tile * dim,), float("nan"))
        for _ in range(2)
    ]
    got = torch.ops.cortex.paged_prefill_attention(
        query, keys, values, table, start, block_size, 0.3, tile, *scratch
    )
    assert got.shape == (length, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want[0].transpose(0, 1), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "arch, decode, reads_in_place",
    [
        ("llama", "auto", True),
        ("gemma3_text", "eager", True),  # sliding windows
        (
            "gemma2",
            "auto",
            False,
        ),  # eager attention (its logits are soft-capped there): it keeps the copy
        (
            "llama",
            "compiled",
            True,
        ),  # compiled on a CPU, the kernel an opaque operator (node_agent/model/compiled_step.py)
    ],
)
def test_cpu_models_that_run_sdpa_read_in_place(small_vocab_dirs, arch, decode, reads_in_place):
    lm = loader.load(tiny_profile(small_vocab_dirs[arch], decode=decode), "cpu")
    assert (
        lm.model.config.get_text_config()._attn_implementation == cpu_attention.NAME
    ) is reads_in_place


def test_without_a_compiler_decode_keeps_the_copy_and_says_why(
    small_vocab_dirs, monkeypatch, caplog
):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(
        cpu_kernels, "registered", lambda: False
    )  # as in a process that never loaded it
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="node_agent.model.cpu_kernels"):
            lm = loader.load(tiny_profile(small_vocab_dirs["llama"]), "cpu")
    finally:
        cpu_kernels.load.cache_clear()
    assert lm.model.config._attn_implementation == "sdpa"
    assert "could not be built" in caplog.text and "g++: command not found" in caplog.text


@pytest.mark.parametrize(
    "arch", ["llama", "gemma3_text"]
)  # gemma3: sliding and full layers, two masks
def test_decode_rows_and_chunks_packed_in_one_forward_give_the_separate_forwards_logits(
    small_vocab_dirs, arch
):
    """Rows 0-1 decode (their prompts already cached), rows 2-3 read prompt chunks (one from the start,
    one from position 12): packed into one forward, each token's hidden state is the one the decode
    step and the chunk forward give it apart."""
    lm = loader.load(tiny_profile(small_vocab_dirs[arch], slots=4), "cpu")
    cache = Engine(lm, tiny_profile(small_vocab_dirs[arch], slots=4)).cache
    per_row = 4
    cache.block_tables[:4, :per_row] = (torch.randperm(4 * per_row) + 1).view(4, per_row)
    torch.manual_seed(1)
    prompts = torch.randint(3, 200, (4, 30))
    with torch.inference_mode():
        history = torch.arange(20)[None].repeat(4, 1)  # what each row has cached: 20 positions
        forward.forward(lm.model, cache, slice(0, 4), prompts[:, :20], history, history, 20)
        decode_positions, chunks = (
            torch.tensor([20, 17]),
            [(2, 0, 9), (3, 12, 8)],
        )  # (row, start, length)
        apart = [
            forward.decode_step(
                lm.model,
                cache,
                prompts[:2, 20],
                decode_positions,
                torch.zeros(2, dtype=torch.long),
                32,
            )
        ]
        for row, start, length in chunks:
            positions = torch.arange(start, start + length)[None]
            hidden = forward.forward(
                lm.model,
                cache,
                slice(row, row + 1),
                prompts[row : row + 1, start : start + length],
                positions,
                positions,
                start + length,
            )
            apart.append(forward.logits(lm.model, hidden[0]))
        packed, offset = [], 2
        for row, start, length in chunks:
            packed.append(PackedChunk(row=row, start=start, length=length, offset=offset))
            offset += length
        tokens = torch.cat(
            [prompts[:2, 20]]
            + [prompts[row, start : start + length] for row, start, length in chunks]
        )
        positions = torch.cat(
            [decode_positions]
            + [torch.arange(start, start + length) for _, start, length in chunks]
        )
        together = forward.logits(
            lm.model,
            forward.packed_forward(lm.model, cache, tokens, positions, torch.arange(2), packed),
        )
    torch.testing.assert_close(together, torch.cat(apart), atol=1e-4, rtol=1e-4)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch waits forever on a build directory's `lock` file; one left by a build that was killed
    (a node stopped while loading its first model) must not hang every later load on the machine."""
    from torch.utils.cpp_extension import _get_build_directory

    left = Path(_get_build_directory(cpu_kernels.library_name(), False)) / "lock"
    left.touch()
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "from node_agent.model import cpu_kernels; print(cpu_kernels.load())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert "left by a build of the CPU kernels that was killed" in loaded.stderr
    assert not left.exists()
