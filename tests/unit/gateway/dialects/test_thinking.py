"""A thinking model's answer split into thinking and content, however the text arrives in steps."""

import pytest

from gateway.dialects.tools.thinking import ThinkingSplitter


def split(*steps: str) -> tuple[str, str]:
    splitter = ThinkingSplitter()
    parts = [splitter.feed(step) for step in steps] + [splitter.finish()]
    return "".join(t for t, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(
    "steps",
    [
        ["<think>\nLet me see.\n</think>\n\nParis."],
        [
            "<th",
            "ink>\nLet me",
            " see.\n</th",
            "ink>",
            "\n",
            "\nParis.",
        ],  # tags and blank lines across steps
        ["\n<think>\nLet me see.\n</think>\n\nPar", "is."],
    ],
)
def test_thinking_then_content(steps):
    assert split(*steps) == ("\nLet me see.\n", "Paris.")


def test_an_answer_that_does_not_open_with_think_is_all_content():
    assert split("Par", "is <think>no</think>") == ("", "Paris <think>no</think>")
    assert split("<th", "e answer>") == ("", "<the answer>")


def test_cut_off_while_thinking_is_all_thinking():
    assert split("<think>hmm, </thi") == ("hmm, </thi", "")


def test_each_step_gives_what_it_can_at_once():
    splitter = ThinkingSplitter()
    assert splitter.feed("<think>a</") == ("a", "")  # "</" may open the closing tag: held back
    assert splitter.feed("b") == ("</b", "")
    assert splitter.feed("</think>c") == ("", "c")
