"""The embeddings, rerank and score request types: every shape of `input` OpenAI allows becomes a
list of inputs; what it does not allow is refused before any job is queued, and so is
`dimensions` for a model not trained for it."""

import pytest
from pydantic import ValidationError

from gateway.dialects.protocol.embeddings import EmbeddingCreateParams
from gateway.dialects.protocol.rerank import RerankRequest, ScoreRequest
from gateway.jobs.pooling import check_dimensions
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest


@pytest.mark.parametrize(
    "given,inputs",
    [
        ("a text", ["a text"]),
        (["one", "two"], ["one", "two"]),
        ([101, 7, 102], [[101, 7, 102]]),  # one input's token ids
        ([[101, 7], [5]], [[101, 7], [5]]),
    ],
)
def test_every_input_shape_becomes_a_list_of_inputs(given, inputs):
    assert EmbeddingCreateParams(model="m", input=given).inputs == inputs


@pytest.mark.parametrize("given", [[], [[]], [-1], ["a", 1], [["a"]], ["x"] * 2049])
def test_empty_mixed_or_too_many_inputs_are_refused(given):
    with pytest.raises(ValidationError):
        EmbeddingCreateParams(model="m", input=given)


def test_encoding_format_and_dimensions_are_checked():
    with pytest.raises(ValidationError):
        EmbeddingCreateParams(model="m", input="x", encoding_format="int8")
    with pytest.raises(ValidationError):
        EmbeddingCreateParams(model="m", input="x", dimensions=0)


def test_rerank_documents_are_texts_or_objects_with_text():
    request = RerankRequest(model="m", query="q", documents=["a", {"text": "b"}])
    assert request.texts == ["a", "b"] and request.top_n is None and not request.return_documents
    with pytest.raises(ValidationError):
        RerankRequest(model="m", query="q", documents=[])


@pytest.mark.parametrize(
    "text_1,text_2,pairs",
    [
        ("q", "d", (["q"], ["d"])),
        ("q", ["d1", "d2"], (["q", "q"], ["d1", "d2"])),
        (["q"], ["d1", "d2"], (["q", "q"], ["d1", "d2"])),
        (["q1", "q2"], ["d1", "d2"], (["q1", "q2"], ["d1", "d2"])),
    ],
)
def test_score_pairs_text_1_with_text_2(text_1, text_2, pairs):
    assert ScoreRequest(model="m", text_1=text_1, text_2=text_2).pairs() == pairs


def test_score_lists_of_different_lengths_are_refused():
    with pytest.raises(ValidationError, match="text_2: a list of text_1 pairs"):
        ScoreRequest(model="m", text_1=["a", "b"], text_2=["c"])


@pytest.mark.parametrize(
    "trained,dimensions,refusal",
    [
        (None, None, None),
        (None, 64, "was not trained for truncated embeddings"),
        ([], 17, None),  # any size (the node checks it is within the vector)
        ([64, 128], 128, None),
        ([64, 128], 100, "takes dimensions of 64, 128; got 100"),
    ],
)
def test_dimensions_only_for_models_trained_for_them(trained, dimensions, refusal):
    profile = ModelProfile(id="e", source="x", kind="embedding", matryoshka_dimensions=trained)
    if refusal is None:
        check_dimensions(profile, dimensions)
    else:
        with pytest.raises(InvalidRequest, match=refusal) as refused:
            check_dimensions(profile, dimensions)
        assert refused.value.param == "dimensions"
