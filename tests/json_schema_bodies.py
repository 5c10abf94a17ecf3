"""Hypothesis strategies for request bodies from the JSON schemas pydantic makes of the gateway's
request models (as its OpenAPI document carries them): bodies that follow the schema, and bodies
in which any value may be replaced by any JSON value at all (wrong types, huge integers, strings
holding unpaired surrogates, deep nesting)."""

from typing import Any

from hypothesis import strategies as st

MAX_ITEMS = 3
# any code point, surrogates included (`st.characters()` leaves them out by default)
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
DEEPEST = 600  # levels of nesting a drawn value may have: past pydantic's serializer (~250), within json's parser (~1,000)


def nested(depth: int, leaf: Any = "x") -> Any:
    """`leaf` inside `depth` objects and arrays, alternately."""
    for level in range(depth):
        leaf = {"a": leaf} if level % 2 else [leaf]
    return leaf


ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=MAX_ITEMS) | st.dictionaries(TEXT, inner, max_size=MAX_ITEMS)
    ),
    max_leaves=8,
) | st.integers(1, DEEPEST).map(nested)


class Bodies:
    """Strategies for the schemas of one OpenAPI document's components."""

    def __init__(self, components: dict[str, Any]):
        self.components = components
        self._refs: dict[tuple[str, bool], st.SearchStrategy] = {}

    def of(self, schema: dict[str, Any], *, junk: bool = False) -> st.SearchStrategy:
        """Values of `schema`; with `junk`, any of them may be replaced by any JSON value."""
        typed = self._typed(schema, junk)
        return st.one_of(typed, typed, typed, ANY_JSON) if junk else typed

    def _typed(self, schema: dict[str, Any], junk: bool) -> st.SearchStrategy:
        if "$ref" in schema:
            return self._ref(schema["$ref"].rsplit("/", 1)[-1], junk)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for combined in ("anyOf", "oneOf", "allOf"):
            if combined in schema:
                return st.one_of([self.of(branch, junk=junk) for branch in schema[combined]])
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return st.one_of([self._typed(schema | {"type": kind}, junk) for kind in kinds])
        return self._of_type(kinds, schema, junk)

    def _ref(self, name: str, junk: bool) -> st.SearchStrategy:
        if (name, junk) not in self._refs:  # deferred: schemas refer to themselves (nested content)
            self._refs[name, junk] = st.deferred(lambda: self._typed(self.components[name], junk))
        return self._refs[name, junk]

    def _of_type(self, kind: str | None, schema: dict[str, Any], junk: bool) -> st.SearchStrategy:
        if kind == "object":
            return self._object(schema, junk)
        if kind == "array":
            if "prefixItems" in schema:
                return st.tuples(*(self.of(item, junk=junk) for item in schema["prefixItems"])).map(
                    list
                )
            items = self.of(schema.get("items", {}), junk=junk)
            return st.lists(
                items, min_size=min(schema.get("minItems", 0), MAX_ITEMS), max_size=MAX_ITEMS
            )
        if kind == "string":
            return st.one_of(TEXT, st.text(max_size=12))
        if kind == "integer":
            low, high = (
                None if (bound := schema.get(name)) is None else int(bound)
                for name in ("minimum", "maximum")
            )
            return st.integers(low, high) | st.integers(-3, 300)
        if kind == "number":
            return st.floats(
                schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return ANY_JSON

    def _object(self, schema: dict[str, Any], junk: bool) -> st.SearchStrategy:
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {name: self.of(sub, junk=junk) for name, sub in properties.items()}
        optional = [name for name in properties if name not in required]
        chosen = (
            st.sets(st.sampled_from(optional), max_size=len(optional))
            if optional
            else st.just(set())
        )
        extra = schema.get("additionalProperties")
        values = self.of(extra, junk=junk) if isinstance(extra, dict) else ANY_JSON

        @st.composite
        def build(draw) -> dict[str, Any]:
            names = sorted(required | draw(chosen))
            body = {name: draw(fields[name]) for name in names}
            if extra is not None and extra is not False:
                body |= draw(st.dictionaries(st.text(max_size=8), values, max_size=2))
            return body

        return build()
