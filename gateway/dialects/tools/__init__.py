"""Tools and structured output, for every dialect: `parsers` reads tool calls out of a model's
text; `grammars` turns what a request forces (a call, JSON output) into a grammar for the node."""
