from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.engine.detokenize import IncrementalDetokenizer, StopStrings, TokenizerText

TEXTS = [
    "héllo wörld 日本語 🎉",
    "naïve café — “quotes” and emoji 👩‍👩‍👧",
    "plain ascii text, nothing special",
]


def test_multibyte_characters_are_never_split_across_deltas(smol_tokenizer):
    for text in TEXTS:
        detok = IncrementalDetokenizer(TokenizerText.of(smol_tokenizer))
        deltas = [detok.add(i) for i in smol_tokenizer.encode(text, add_special_tokens=False)]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text


class DecodeOnly:
    """A tokenizer with no Rust backend (SentencePiece- or Python-based): only `decode`."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def test_the_output_process_decodes_as_transformers_does_without_it(smol_tokenizer):
    """Carried over (`dumps`/`loads`) and decoded by the Rust backend alone, a token's text, special
    or not, cleaned up where transformers cleans up, is transformers' own."""
    carried = TokenizerText.loads(TokenizerText.of(smol_tokenizer).dumps())
    ids = smol_tokenizer.encode(
        "Hello , world . It 's <|im_end|> done !", add_special_tokens=False
    ) + [0, 1, 2]
    for token in ids:
        assert carried.decode([token]) == smol_tokenizer.decode([token])
    assert carried.decode(ids, skip_special_tokens=True) == smol_tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_a_wordpiece_tokenizer_is_cleaned_up_as_transformers_cleans_it():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        t: i
        for i, t in enumerate(
            ["[UNK]", "[SEP]", "hello", ",", "world", ".", "it", "'", "s", "!", "##s"]
        )
    }
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )
    carried = TokenizerText.loads(TokenizerText.of(tokenizer).dumps())
    ids = tokenizer.encode("hello , world . it ' s worlds !", add_special_tokens=False) + [1]
    assert (
        carried.clean_up
        and carried.decode(ids) == tokenizer.decode(ids) == "hello, world. it's worlds! [SEP]"
    )
    assert carried.decode(ids, skip_special_tokens=True) == tokenizer.decode(
        ids, skip_special_tokens=True
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 49151), min_size=1, max_size=40), st.sampled_from(["rust", "python"])
)
def test_deltas_add_up_to_the_whole_decode(smol_tokenizer, ids, path):
    """Any ids (special tokens, bytes of split characters included), on either path: the deltas
    are the plain decode of all of them, less a tail that ends in half a character (held back
    until it is whole)."""
    detok = IncrementalDetokenizer(
        TokenizerText.of(smol_tokenizer if path == "rust" else DecodeOnly(smol_tokenizer))
    )
    assert (detok.stream is not None) == (path == "rust")
    text = "".join(detok.add(i) for i in ids)
    full = smol_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert text == full or (full.startswith(text) and full.endswith("\ufffd"))


def test_stop_string_split_over_many_deltas_is_caught_and_withheld():
    stops = StopStrings(["STOP here"])
    out = []
    for piece in ["abc S", "TO", "P h", "ere and more"]:
        text, hit = stops.feed(piece)
        out.append(text)
        if hit:
            break
    assert hit and "".join(out) == "abc "


def test_held_text_that_was_no_stop_comes_out():
    stops = StopStrings(["xyz"])
    assert stops.feed("abx") == ("ab", False)
    assert stops.feed("y1") == ("xy1", False)
    assert stops.feed("x") == ("", False)
    assert stops.flush() == "x"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abxyz ", max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_emitted_text_is_the_text_before_the_first_stop(text, cuts):
    stops = StopStrings(["xyz", "bb"])
    pieces, rest = [], text
    for c in cuts:
        pieces.append(rest[:c])
        rest = rest[c:]
    pieces.append(rest)
    out, hit = "", False
    for piece in pieces:
        emitted, hit = stops.feed(piece)
        out += emitted
        if hit:
            break
    if not hit:
        out += stops.flush()
    first = min((i for i in (text.find("xyz"), text.find("bb")) if i >= 0), default=None)
    assert hit == (first is not None)
    assert out == (text[:first] if first is not None else text)
