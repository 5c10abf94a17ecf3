"""Vision prompts through the engine: tiny random Qwen2.5-VL (M-RoPE), Qwen3.5 with vision (linear
attention, M-RoPE), Gemma 3 (sliding windows, images attended both ways) and Idefics3 (SmolVLM:
tiled images) models with real processors, fed real PNG/JPEG bytes. The engine's greedy tokens
and prompt logprobs equal HF's on the same processed inputs, alone, across chunk boundaries
inside the image, and batched with text."""

import pytest
import torch
from transformers import AutoConfig

from node_agent.engine.engine import Engine, check_fits
from node_agent.model import vision
from node_agent.serving import prompts
from node_agent.tp import tensor_parallel
from shared.errors import InvalidRequest
from shared.model_files import ModelLoadError
from shared.wire import GenerationRequest, SamplingParams
from tests.image_files import image_bytes
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent import engine_driver

QUESTION = "Describe this picture in a few words, please, and say what colours it has"


def image_request(
    job: str, image: bytes, max_tokens: int = 8, text_first: bool = True
) -> GenerationRequest:
    parts = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    return GenerationRequest(
        job=job,
        model="m",
        kind="chat",
        images=[image],
        messages=[{"role": "user", "content": parts if text_first else parts[::-1]}],
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def hf_greedy(lm, request: GenerationRequest, n: int) -> list[int]:
    """The reference: HF generate on the processor's own outputs for the same messages and image."""
    ids, images = prompts.vision_prompt(lm.processor, engine_profile(lm), request)
    inputs = {k: torch.from_numpy(v) for k, v in images.items()} | {
        "input_ids": torch.tensor([ids])
    }
    out = lm.model.generate(
        **inputs,
        attention_mask=torch.ones_like(inputs["input_ids"]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()


def engine_profile(lm):
    return lm.profile


@pytest.fixture
def vl(tiny_vision):
    profile, lm = tiny_vision
    lm.profile = profile
    return profile, lm


def add(engine: Engine, request: GenerationRequest) -> None:
    ids, images = prompts.vision_prompt(engine.lm.processor, engine.profile, request)
    check_fits(engine.max_len, len(ids), request.sampling.max_tokens)
    engine.add(request, ids, 0.0, images)


def run(engine: Engine, *requests: GenerationRequest) -> dict[str, engine_driver.Result]:
    results = {r.job: engine_driver.Result() for r in requests}
    for r in requests:
        add(engine, r)
    while engine.has_work:
        for job, events in engine.step():
            engine_driver.collect(results[job], events)
    return results


def test_the_processor_expands_the_image_and_rope_follows_the_model(vl):
    profile, lm = vl
    ids, images = prompts.vision_prompt(
        lm.processor, profile, image_request("a", image_bytes(size=(100, 80)))
    )
    assert ids.count(vision.image_token_id(lm.model.config)) > 1 and "pixel_values" in images
    with torch.inference_mode():
        prompt = vision.embed_prompt(lm.model, ids, images, lm.device)
    assert prompt.embeds.shape == (len(ids), lm.model.config.get_text_config().hidden_size)
    if lm.model.config.model_type in (
        "qwen2_5_vl",
        "qwen3_5",
    ):  # M-RoPE: an image takes fewer rope positions than columns
        assert prompt.rope.shape == (3, len(ids)) and prompt.rope_delta < 0
    else:
        assert prompt.rope is None and prompt.rope_delta == 0


@pytest.mark.parametrize(
    "fmt, size, text_first", [("PNG", (100, 80), True), ("JPEG", (64, 64), False)]
)
def test_greedy_tokens_equal_hf_alone_and_batched_with_text(vl, fmt, size, text_first):
    profile, lm = vl
    image = image_bytes(fmt, size)
    request = image_request("img", image, text_first=text_first)
    want = hf_greedy(lm, request, 8)
    alone = run(Engine(lm, profile), request)["img"]
    assert alone.token_ids[0] == want
    # the text jobs end first, so the image row moves down (its rope offset with it); its prompt's
    # chunks (16 tokens) cross the image's tokens and share prefill steps with text prompts
    texts = [
        engine_driver.request(f"t{i}", text, temperature=0, max_tokens=2 + i, ignore_eos=True)
        for i, text in enumerate(engine_driver.PROMPTS[:3])
    ]
    batched = run(
        Engine(lm, profile),
        texts[0],
        image_request("img", image, text_first=text_first),
        *texts[1:],
    )
    assert batched["img"].token_ids[0] == want
    for text in texts:
        assert batched[text.job].token_ids[0] == hf_greedy(lm, text, text.sampling.max_tokens)


def test_prompt_logprobs_equal_a_full_forward_of_the_hf_model(vl):
    """Every prompt token's logprob, image tokens included, as HF's one forward over the whole prompt
    (with its bidirectional image attention, where the model has it) gives it, although the engine
    reads the prompt in chunks: alone, with a chunk boundary two tokens into the image, and in chunks
    of 16 beside a text prompt."""
    profile, lm = vl
    request = image_request("img", image_bytes(size=(100, 80)), max_tokens=1)
    request.sampling.prompt_logprobs = 0
    ids, images = prompts.vision_prompt(lm.processor, profile, request)
    inputs = {k: torch.from_numpy(v) for k, v in images.items()} | {
        "input_ids": torch.tensor([ids])
    }
    with torch.inference_mode():
        logits = (
            lm.model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]))
            .logits[0]
            .float()
        )
    want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    text = engine_driver.request("text", engine_driver.PROMPTS[5], temperature=0, max_tokens=2)
    image_starts = ids.index(vision.image_token_id(lm.model.config))
    assert image_starts + 2 >= 16
    for engine, requests in [
        (
            Engine(lm, profile.model_copy(update={"prefill_chunk_tokens": image_starts + 2})),
            [request],
        ),
        (Engine(lm, profile), [text, request]),
    ]:
        got = run(engine, *requests)["img"].prompt_logprobs[0]
        assert got[0].logprob is None and len(got) == len(ids)
        torch.testing.assert_close(
            torch.tensor([entry.logprob for entry in got[1:]]), want, rtol=1e-4, atol=1e-4
        )


def test_two_images_and_n_sequences_share_one_embedding(vl):
    profile, lm = vl
    request = image_request("two", image_bytes(seed=1), max_tokens=4)
    request.messages[0]["content"].append({"type": "image"})
    request.images.append(image_bytes("JPEG", (40, 90), seed=2))
    want = hf_greedy(lm, request, 4)
    request.sampling.n = 2
    result = run(Engine(lm, profile), request)["two"]
    assert result.token_ids[0] == result.token_ids[1] == want


def test_an_image_count_that_does_not_match_the_parts_is_refused(vl):
    profile, lm = vl
    request = image_request("bad", image_bytes())
    request.images.append(image_bytes())
    with pytest.raises(InvalidRequest, match="1 image parts for 2 images"):
        prompts.vision_prompt(lm.processor, profile, request)


def test_a_prompt_whose_images_do_not_fit_its_tokens_fails_alone(vl):
    profile, lm = vl
    request = image_request("bad", image_bytes())
    ids, _ = prompts.vision_prompt(lm.processor, profile, request)
    two = image_request("two", image_bytes())
    two.messages[0]["content"].append({"type": "image"})
    two.images.append(image_bytes())
    _, other_images = prompts.vision_prompt(lm.processor, profile, two)
    engine = Engine(lm, profile)
    text = engine_driver.request(
        "text", "Hello there", temperature=0, max_tokens=3, ignore_eos=True
    )
    engine_driver.add(engine, text)
    engine.add(request, ids, 0.0, other_images)  # features of two images for one image's tokens
    results = {"bad": engine_driver.Result(), "text": engine_driver.Result()}
    errors = []
    while engine.has_work:
        for job, events in engine.step():
            errors += [e for e in events if e.type == "error"]
            if job == "text":
                engine_driver.collect(results[job], events)
    assert [e.code for e in errors] == ["generation_failed"] and "image tokens" in errors[0].message
    assert (
        len(results["text"].token_ids[0]) == 3
        and not engine.jobs
        and not engine.scheduler.rows
        and engine.pool.used == 0
    )


def test_a_vision_model_is_not_sharded(tiny_vision_dirs):
    folder = tiny_vision_dirs["qwen2_5_vl"]
    with pytest.raises(ModelLoadError, match="vision models .* tensor_parallel = 1"):
        tensor_parallel.check(
            tiny_profile(folder, vision=True, tensor_parallel=2),
            AutoConfig.from_pretrained(folder),
            ["cpu:0", "cpu:1"],
        )


def test_a_preempted_image_prompt_resumes_with_the_tokens_hf_gives(vl):
    """Three image prompts in a cache that holds their prompts but not their answers: the newest is
    preempted while decoding and recomputed from its prompt and output (image embeddings, then its
    tokens after the prompt)."""
    profile, lm = vl
    if lm.model.config.model_type not in ("qwen2_5_vl", "gemma3"):
        pytest.skip(
            "the resume path is covered by an M-RoPE model and one whose images attend both ways"
        )
    requests = [
        image_request(f"img{i}", image_bytes(size=(64 + 8 * i, 64)), max_tokens=24)
        for i in range(3)
    ]
    engine = Engine(lm, profile)
    size = engine.pool.block_size
    engine.pool.__init__(
        sum(
            -(-(len(prompts.vision_prompt(lm.processor, profile, r)[0]) + 1) // size)
            for r in requests
        ),
        size,
    )
    results = run(engine, *requests)
    assert engine.kv_stats().preemptions > 0 and engine.pool.used == 0
    for r in requests:
        assert results[r.job].token_ids[0] == hf_greedy(lm, r, 24)
