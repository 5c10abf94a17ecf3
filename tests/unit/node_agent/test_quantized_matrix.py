"""The architecture matrix with its Linear weights quantized at load (`quant = "int4"`, `"int8"`):
every architecture loads quantized and runs in the engine (continuous batching, chunked prefill,
more jobs than slots). With 4-bit weights (bfloat16 activations, each row on its own) the engine
decodes greedily what full forwards of the same quantized model decode (asserted). A CPU's int8 is
torch's dynamic int8, which quantizes the activations of a whole batch with one scale, so a row's
answer depends on the rows beside it: there only the tokens' count is asserted. How often the
quantized model's greedy tokens agree with the full-precision model's is reported, not asserted
(a tiny random model's near ties move): each case records it as a property of its test
(`--junitxml`), and `-s` prints it; docs/benchmarks.md gives the figures."""

import pytest

from node_agent.engine.engine import Engine
from node_agent.model import compiled_step, loader
from node_agent.serving import prompts
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import full_forward_greedy, request, run
from tests.unit.node_agent.test_architectures import MATRIX, REQUESTS, references  # noqa: F401  (a fixture)


def agreeing(tokens: list[int], reference: list[int]) -> int:
    """Tokens equal to the reference's before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))


# compiled: 4-bit layers in a compiled decode step (opaque to Inductor: node_agent/model/compiled_step.py)
@pytest.mark.parametrize(
    "bits, decode", [("int4", "eager"), ("int8", "eager"), ("int4", "compiled")]
)
@pytest.mark.parametrize("arch", MATRIX)
def test_a_quantized_model_runs_the_matrix_in_the_engine(
    references,  # noqa: F811  (the fixture imported above)
    small_vocab_dirs,
    arch,
    bits,
    decode,
    record_property,
):
    _, _, full_precision = references(arch)
    quantized = tiny_profile(
        small_vocab_dirs[arch], prefill_chunk_tokens=16, slots=4, quant=bits, decode=decode
    )
    lm = loader.load(quantized, "cpu")
    assert lm.quant == bits  # (on a CPU, "int8" is torch's dynamic int8 layers)
    engine = Engine(lm, quantized)
    if decode == "compiled":  # wherever the model allows it (else eager, for the reason logged)
        assert (engine.decoder.name == "compiled") == (
            compiled_step.why_not(lm.model, engine.cache) is None
        )
    results = run(engine, *REQUESTS, join_every=2)
    agreed = total = 0
    for r in REQUESTS:
        tokens = results[r.job].token_ids[0]
        assert len(tokens) == r.sampling.max_tokens, r.job
        if bits == "int4":
            ids = prompts.prompt_ids(lm.tokenizer, quantized, r)
            assert tokens == full_forward_greedy(lm, ids, r.sampling.max_tokens), r.job
        agreed += agreeing(tokens, full_precision[r.job][0])
        total += r.sampling.max_tokens
    record_property("greedy_agreement_with_full_precision", f"{agreed}/{total}")
    print(
        f"{arch} {bits} {decode}: {agreed} of {total} tokens agree with full precision before the first difference"
    )


LONG = "The quick brown fox jumps over the lazy dog, then naps in the sun. "  # ~70 tokens


# a 4-bit layer's three CPU paths in one run: a prefill chunk of 256 rows (on a CPU with AMX, the
# bfloat16 tiles: from 128 rows), the prompt's last ~100 rows (the float32 tiles), decode rows
# (torch's int4 kernel), two prompts at once
@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_a_long_prompts_prefill_chunks_decode_what_full_forwards_do(small_vocab_dirs, decode):
    profile = tiny_profile(
        small_vocab_dirs["llama"],
        prefill_chunk_tokens=256,
        slots=2,
        max_model_len=1024,
        quant="int4",
        decode=decode,
    )
    lm = loader.load(profile, "cpu")
    long_requests = [
        request(f"long{i}", LONG * (5 + i), temperature=0, max_tokens=8, ignore_eos=True)
        for i in range(2)
    ]
    results = run(Engine(lm, profile), *long_requests)
    for r in long_requests:
        ids = prompts.prompt_ids(lm.tokenizer, profile, r)
        assert len(ids) > 256, len(ids)  # a whole chunk of 256 rows, then the rest
        assert results[r.job].token_ids[0] == full_forward_greedy(lm, ids, 8), r.job
