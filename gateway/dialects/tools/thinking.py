"""A thinking model's answer → its thinking and its content, as the text streams in.

Thinking models (Qwen3, DeepSeek-R1 and their kin) open their answer with `<think>`, think, close
with `</think>` and then answer; Ollama's `think: true` returns the two apart (`message.thinking`,
`thinking`). An answer that does not open with `<think>` is all content; one cut off before
`</think>` is all thinking. A tag split across steps is held back until it is whole.
"""

from gateway.dialects.tools.parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ThinkingSplitter:
    def __init__(self) -> None:
        self.state = "start"  # start (deciding) → thinking → after (the closing tag) → content
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The step's new (thinking, content)."""
        self.held += text
        thinking = ""
        if self.state == "start":
            opening = self.held.lstrip()
            if OPEN.startswith(opening):  # all blank, or a part of `<think>` so far
                return "", ""
            thinks = opening.startswith(OPEN)
            self.state, self.held = (
                ("thinking", opening[len(OPEN) :]) if thinks else ("content", self.held)
            )
        if self.state == "thinking":
            if CLOSE not in self.held:
                keep = len(self.held) - partial_suffix(self.held, CLOSE)
                thinking, self.held = self.held[:keep], self.held[keep:]
                return thinking, ""
            thinking, self.held = self.held.split(CLOSE, 1)
            self.state = "after"
        if self.state == "after":  # the blank lines between the thinking and the answer are neither
            self.held = self.held.lstrip("\n")
            if not self.held:
                return thinking, ""
            self.state = "content"
        content, self.held = self.held, ""
        return thinking, content

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: thinking if the answer was still thinking, else content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)
