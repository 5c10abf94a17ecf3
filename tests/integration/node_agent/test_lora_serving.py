"""LoRA adapters behind a real gateway and node agent: the OpenAI SDK's `model=<adapter>` works
unchanged, for an adapter declared in the catalogue and one loaded with vLLM's
`POST /v1/load_lora_adapter` body (admin key), greedy-equal to PEFT's merged model; `/v1/models`
lists adapters with `parent` their base; adapters that cannot be served (rank over the limit,
another base's, missing files) fail their own requests with a 400 saying why while the base's
requests, sent at the same time, finish."""

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from node_agent.serving import prompts
from tests import tiny_models
from tests.integration.fleet.conftest import catalogue
from tests.model_fixtures import tiny_profile
from tests.stack import Stack, serving
from tests.unit.node_agent.engine_driver import full_forward_greedy, request

pytestmark = pytest.mark.integration

BASE, ADMIN_KEY, MAX_TOKENS = "tiny", "lora-admin-key-0123456789", 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write a poem about the sea and the sky"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, small_vocab_dirs) -> dict:
    root, base = tmp_path_factory.mktemp("adapters"), small_vocab_dirs["llama"]
    other = root / "other-base"  # another width: its adapters do not fit
    config = AutoConfig.from_pretrained(base)
    config.hidden_size = 32
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    return {
        "support-bot": tiny_models.save_lora_adapter(base, root / "a4", 4, ALL, 1),
        "runtime": tiny_models.save_lora_adapter(base, root / "a8", 8, ["q_proj", "v_proj"], 2),
        "big": tiny_models.save_lora_adapter(base, root / "big", 16, ["q_proj"], 3),
        "wrong": tiny_models.save_lora_adapter(other, root / "wrong", 4, ["q_proj"], 4),
        "missing": root / "nowhere",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_vocab_dirs, adapters) -> Iterator[Stack]:
    toml = catalogue(small_vocab_dirs["llama"], **{BASE: {"max_loras": 2, "max_lora_rank": 8}})
    for name in ("support-bot", "big", "wrong", "missing"):
        toml += f'\n[[models]]\nid = "{name}"\nbase = "{BASE}"\nadapter = "{adapters[name]}"\n'
    with serving(
        tmp_path_factory.mktemp("lora"), toml, "n1", [BASE], CORTEX_ADMIN_KEY=ADMIN_KEY
    ) as stack:
        yield stack


def greedy(client: openai.OpenAI, model: str) -> list[str]:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    return [entry.token for entry in out.choices[0].logprobs.content]


def reference(base_dir, adapter_dir=None) -> list[str]:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).merge_and_unload()
    profile = tiny_profile(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    ids = prompts.prompt_ids(tokenizer, profile, request("ref", PROMPT))
    lm = SimpleNamespace(model=model.eval(), device=torch.device("cpu"))
    return [tokenizer.decode([t]) for t in full_forward_greedy(lm, ids, MAX_TOKENS)]


def admin(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway_url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )


def test_the_sdk_names_adapters_as_models(stack, adapters, small_vocab_dirs):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
    base_dir = small_vocab_dirs["llama"]
    # vLLM's body, as its clients send it; a plain key may not
    body = {"lora_name": "runtime", "lora_path": str(adapters["runtime"])}
    assert httpx.post(f"{stack.gateway_url}/v1/load_lora_adapter", json=body).status_code in (
        401,
        403,
    )
    loaded = admin(stack, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    with ThreadPoolExecutor(3) as pool:
        got = dict(
            zip(
                [BASE, "support-bot", "runtime"],
                pool.map(lambda m: greedy(client, m), [BASE, "support-bot", "runtime"]),
            )
        )
    assert got[BASE] == reference(base_dir)
    assert got["support-bot"] == reference(base_dir, adapters["support-bot"]) != got[BASE]
    assert got["runtime"] == reference(base_dir, adapters["runtime"]) != got[BASE]
    listed = {m.id: m for m in client.models.list().data}
    assert listed["support-bot"].parent == BASE and listed["runtime"].parent == BASE
    assert admin(stack, "/v1/unload_lora_adapter", {"lora_name": "runtime"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        greedy(client, "runtime")
    stack.assert_clean()


def test_adapters_that_cannot_load_fail_alone(stack):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
    why = {
        "big": "rank 16 is over this model's max_lora_rank (8)",
        "wrong": "another base",
        "missing": "no adapter_config.json",
    }

    def attempt(model: str):
        try:
            return greedy(client, model)
        except openai.BadRequestError as exc:
            return exc

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip([BASE, *why], pool.map(attempt, [BASE, *why])))
    assert isinstance(results[BASE], list) and len(results[BASE]) == MAX_TOKENS
    for model, reason in why.items():
        assert isinstance(results[model], openai.BadRequestError), model
        assert reason in str(results[model]) and results[model].code == "adapter_load_failed"
    assert len(greedy(client, BASE)) == MAX_TOKENS
    stack.assert_clean()
