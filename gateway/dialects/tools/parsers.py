"""Tool calls in a model's own output format → structured calls, as the text streams in.

Parsing lives in the gateway, on the text the node streams, so the wire stays text and both
dialects (OpenAI `tool_calls`, Anthropic `tool_use` blocks) render from the same pieces. One
parser runs per choice, only for requests that carry tools. Streamed and whole answers go
through the same `feed`/`finish` calls, so they carry the same content.

Formats (`ModelProfile.tool_parser`, else chosen from the model's family by `parser_name`):
- `hermes` (Hermes, Qwen 2/2.5/3, and models without tool templates, which Cortex prompts in
  this format): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, any number, text around.
- `llama3_json` (Llama 3.1+): the answer is `{"name": …, "parameters": {…}}` (`;`-separated).
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (the marker is a special token
  the detokeniser drops, so an answer opening with `[{` counts too).
A call whose opening is `{"name": "…", "arguments":` streams its arguments as they arrive;
anything else is kept whole and parsed at its end; what does not parse comes back as text,
except a call that `max_tokens` cut off (`finish(cut_off=True)`): that is never content.
"""

import hashlib
import itertools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from shared.catalog import ModelProfile

ParserName = Literal["hermes", "llama3_json", "mistral"]


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int  # 0, 1, … within the choice
    id: str  # bare; dialects add their prefix (`call_`, `toolu_`)
    name: str


@dataclass
class CallArgs:
    index: int
    text: str  # the next piece of the call's arguments, as JSON text


Piece = Text | CallStart | CallArgs


def parser_name(profile: ModelProfile) -> ParserName:
    """The catalogue's `tool_parser`, else a guess from the model's name and source."""
    if profile.tool_parser:
        return profile.tool_parser
    name = f"{profile.id} {profile.source}".lower()
    if re.search(r"llama[-_ ]?3", name):
        return "llama3_json"
    if re.search(r"mistral|mixtral|ministral|codestral", name):
        return "mistral"
    return "hermes"


def make_parser(name: ParserName, seed: str | None = None) -> "ToolCallParser":
    """A parser of format `name`; with a `seed`, its calls' ids follow from it (see `ToolCallParser.call_id`)."""
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}[
        name
    ](seed)


Parsers = Callable[
    [], "ToolCallParser | None"
]  # what renderers call per choice: a fresh parser, or None


def no_parser() -> None:
    return None


def parsers_for(name: ParserName, uses_tools: bool, job: str) -> Parsers:
    """A fresh parser of the model's format per choice, or None for a request without tools. The
    n-th parser's call ids follow from the job's id and n: a stream rendered again from the job's
    events (a client resuming it) names its calls as the first rendering did."""
    if not uses_tools:
        return no_parser
    numbers = itertools.count()
    return lambda: make_parser(name, f"{job}:{next(numbers)}")


# ---- one call's JSON object ---------------------------------------------------------------

_OPENING = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])'
)
_MAX_OPENING = 400  # an opening longer than this is not the streamable shape


def _call_from_json(text: str, index: int, call_id: str) -> list[Piece] | None:
    """A whole `{"name", "arguments"|"parameters"}` object → its pieces; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return [
        CallStart(index, call_id, obj["name"]),
        CallArgs(index, json.dumps(args, ensure_ascii=False)),
    ]


class _Call:
    """One call object fed as it streams. Once `{"name": "…", "arguments": ` is read it emits
    the call's start and then the arguments value as it arrives (JSON-aware, so the outer `}`
    is not part of it); otherwise it keeps the text to parse whole at the end. Either way it
    notices where the outer object ends (`closed`, and `rest` is what came after)."""

    def __init__(self, index: int, call_id: str):
        self.index, self.call_id = index, call_id
        self.buf = ""  # the text read so far, until it streams
        self.streaming = False
        self.depth = 0
        self.in_string = self.escaped = False
        self.args_done = False
        self.closed = False
        self.rest = ""
        self._held_ws = ""  # blanks after the arguments value, held until known to be inside it
        self._args_started = False

    def feed(self, text: str) -> list[Piece]:
        if self.closed:
            self.rest += text
            return []
        if self.streaming:
            return self._scan(text, collect=True)
        before = len(self.buf)
        self.buf += text
        match = _OPENING.match(self.buf) if len(self.buf) <= _MAX_OPENING + len(text) else None
        if match is None or match.end() < before:
            self._scan(text, collect=False)
            return []
        self._scan(self.buf[before : match.end()], collect=False)
        self.streaming = True
        name = json.loads(f'"{match.group(1)}"')
        return [
            CallStart(self.index, self.call_id, name),
            *self._scan(self.buf[match.end() :], collect=True),
        ]

    def _scan(self, text: str, collect: bool) -> list[Piece]:
        args = []
        for i, ch in enumerate(text):
            outer_level = self.depth == 1 and not self.in_string
            if collect and not self.args_done and outer_level and ch in ",}":
                self.args_done = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if collect and not self.args_done:
                if outer_level and ch.isspace():
                    self._held_ws += ch if args or self._args_started else ""
                else:
                    self._args_started = True
                    args.append(self._held_ws + ch)
                    self._held_ws = ""
                    if self.depth == 1 and not self.in_string and ch in "}]":
                        self.args_done = True  # the arguments object closed
            if self.depth == 0 and ch in "}]" and not self.in_string:
                self.closed = True
                self.rest = text[i + 1 :]
                break
        return [CallArgs(self.index, "".join(args))] if args else []

    def finish(self) -> list[Piece] | None:
        """Pieces still owed at the call's end; None if it was not a call (the caller keeps the text)."""
        if self.streaming:
            return []
        return _call_from_json(
            self.buf[: len(self.buf) - len(self.rest)].strip(), self.index, self.call_id
        )


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- parsers --------------------------------------------------------------------------------


class ToolCallParser:
    """`feed(text)` → pieces known so far; `finish(cut_off)` → the rest, where `cut_off` says the
    answer ended at `max_tokens` (a call left open then is dropped, not shown as text).
    Whitespace between text and calls is dropped, so `content` is the model's words only."""

    def __init__(self, seed: str | None = None):
        self.seed = seed
        self.calls = 0
        self._held_ws = ""
        self._after_call = False
        self._dropped_ws = ""

    def _text(self, text: str) -> list[Piece]:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        return [Text(body)] if body else []

    def call_id(self, index: int) -> str:
        """The id of the parser's `index`-th call: from its seed when it has one, else random."""
        if self.seed is None:
            return uuid.uuid4().hex[:24]
        return hashlib.sha256(f"{self.seed}:{index}".encode()).hexdigest()[:24]

    def _call_began(self) -> None:
        self._dropped_ws, self._held_ws = self._held_ws, ""

    def _call_ended(self, pieces: list[Piece] | None, raw: str) -> list[Piece]:
        if pieces is None:  # malformed: the model's text, as it wrote it
            self._after_call = False
            return self._text(self._dropped_ws + raw)
        self.calls += 1
        self._after_call = True
        return pieces

    def _flush_text(self) -> list[Piece]:
        held, self._held_ws = self._held_ws, ""
        return [Text(held)] if held and not self.calls else []

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self, cut_off: bool = False) -> list[Piece]:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, seed: str | None = None):
        super().__init__(seed)
        self._pending = ""
        self._call: _Call | None = None
        self._call_text = ""

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._pending += text
        while True:
            tag = self.END if self._call else self.START
            at = self._pending.find(tag)
            if at < 0:
                keep = partial_suffix(self._pending, tag)
                ready, self._pending = (
                    self._pending[: len(self._pending) - keep],
                    self._pending[len(self._pending) - keep :],
                )
                out += self._into_call(ready) if self._call else self._text(ready)
                return out
            before, self._pending = self._pending[:at], self._pending[at + len(tag) :]
            if self._call is None:
                out += self._text(before)
                self._call_began()
                self._call, self._call_text = _Call(self.calls, self.call_id(self.calls)), ""
            else:
                out += self._into_call(before)
                out += self._end_call()

    def _into_call(self, text: str) -> list[Piece]:
        self._call_text += text
        return self._call.feed(text)

    def _end_call(self) -> list[Piece]:
        call, self._call = self._call, None
        pieces = call.finish()
        return self._call_ended(pieces, f"{self.START}{self._call_text}{self.END}")

    def finish(self, cut_off: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self._call is not None:  # ended without its closing tag
            out += self._into_call(self._pending)
            self._pending = ""
            call, self._call = self._call, None
            pieces = call.finish()
            out += (
                []
                if pieces is None and cut_off
                else self._call_ended(pieces, f"{self.START}{self._call_text}")
            )
        elif self._pending and not cut_off:
            out += self._text(self._pending)
        elif (
            self._pending
        ):  # cut off at the start of a `<tool_call>` tag: neither it nor the blank before is text
            self._held_ws = ""
        self._pending = ""
        return out + self._flush_text()


class Llama3JsonParser(ToolCallParser):
    """The whole answer is calls when it opens with `{` (after `<|python_tag|>`, if the
    detokeniser kept it); otherwise it is text."""

    PREFIX = "<|python_tag|>"

    def __init__(self, seed: str | None = None):
        super().__init__(seed)
        self._mode: Literal["undecided", "text", "calls"] = "undecided"
        self._buf = ""
        self._call: _Call | None = None
        self._call_text = ""

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "text":
            return self._text(text)
        if self._mode == "undecided":
            self._buf += text
            head = self._buf.lstrip().removeprefix(self.PREFIX).lstrip()
            if not head or self.PREFIX.startswith(head):
                return []
            text, self._buf = head, ""
            if not head.startswith("{"):
                self._mode = "text"
                return self._text(text)
            self._mode = "calls"
        return self._feed_calls(text)

    def _feed_calls(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self._call is None:
                text = text.lstrip().lstrip(";").lstrip()
                if not text:
                    return out
                self._call, self._call_text = _Call(self.calls, self.call_id(self.calls)), ""
            self._call_text += text
            out += self._call.feed(text)
            if not self._call.closed:
                return out
            text = self._call.rest
            self._call_text = self._call_text[: len(self._call_text) - len(text)]
            out += self._end_call()
        return out

    def _end_call(self) -> list[Piece]:
        call, self._call = self._call, None
        return self._call_ended(call.finish(), self._call_text)

    def finish(self, cut_off: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "undecided" and self._buf:
            out += self._text(self._buf)
        if self._call is not None:
            pieces = self._call.finish()
            out += [] if pieces is None and cut_off else self._end_call()
        return out + self._flush_text()


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` then a JSON list of calls, kept whole and parsed at the end."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, seed: str | None = None):
        super().__init__(seed)
        self._mode: Literal["undecided", "text", "calls"] = "undecided"
        self._buf = ""

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "text":
            return self._text(text)
        self._buf += text
        if self._mode == "calls":
            return []
        head = self._buf.lstrip()
        if not head or self.MARKER.startswith(head) or head == "[":
            return []
        if head.startswith(self.MARKER) or head.startswith("[{") or re.match(r"\[\s+\{", head):
            self._mode = "calls"
            return []
        self._mode, text, self._buf = "text", self._buf, ""
        return self._text(text)

    def finish(self, cut_off: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self._mode != "text" and self._buf:
            out += self._calls(self._buf, cut_off)
        return out + self._flush_text()

    def _calls(self, raw: str, cut_off: bool) -> list[Piece]:
        body = raw.strip().removeprefix(self.MARKER).strip()
        try:
            items = json.loads(body)
        except ValueError:
            items = None
        if not isinstance(items, list) or not items:
            return [] if cut_off else self._text(raw)
        pieces: list[Piece] = []
        for i, item in enumerate(items):
            call = (
                _call_from_json(json.dumps(item), i, self.call_id(i))
                if isinstance(item, dict)
                else None
            )
            if call is None:
                return [] if cut_off else self._text(raw)
            pieces += call
        self.calls = len(items)
        return pieces


# ---- whole answers ------------------------------------------------------------------------


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall]


def collect(pieces: list[Piece]) -> Parsed:
    """Pieces → the text and the calls they make up."""
    text, calls = [], {}
    for piece in pieces:
        if isinstance(piece, Text):
            text.append(piece.text)
        elif isinstance(piece, CallStart):
            calls[piece.index] = ParsedCall(piece.id, piece.name, "")
        else:
            calls[piece.index].arguments += piece.text
    return Parsed("".join(text), [calls[i] for i in sorted(calls)])


def parse(name: ParserName, text: str, cut_off: bool = False) -> Parsed:
    parser = make_parser(name)
    return collect(parser.feed(text) + parser.finish(cut_off))


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as an object (Anthropic's `input`, Ollama's `arguments`); what does
    not parse to an object is kept under `_raw`."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}
