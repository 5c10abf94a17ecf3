"""`models.example.toml` loads as a catalogue and names every ModelProfile field, so it cannot
fall behind shared/catalog.py."""

import re
from pathlib import Path

from shared.catalog import Catalog, ModelProfile

EXAMPLE = Path(__file__).resolve().parents[3] / "models.example.toml"


def test_example_catalogue_loads():
    catalog = Catalog.load(EXAMPLE)

    assert catalog.profiles, "the example defines no models"
    assert catalog.resolve("default").id in catalog.profiles
    sources = [p.source for p in catalog.profiles.values()]
    assert any(s.startswith("pkg:") for s in sources) and any(s.startswith("hf:") for s in sources)
    assert any(s.endswith(".gguf") for s in sources)
    assert any(
        not s.startswith(("pkg:", "hf:")) and not s.endswith(".gguf") for s in sources
    )  # a local dir
    assert any(p.pin for p in catalog.profiles.values())
    assert any(p.labels for p in catalog.profiles.values())


def test_example_names_every_field():
    text = EXAMPLE.read_text()
    # `field = ...` set in a table, or commented out (`# field = ...`), or `# field: what it does`
    named = set(re.findall(r"^\s*#?\s*([a-z_]+)\s*[=:]", text, flags=re.MULTILINE))
    missing = sorted(set(ModelProfile.model_fields) - named)
    assert missing == [], f"models.example.toml does not mention: {missing}"


def test_every_field_set_somewhere_is_a_real_field():
    keys = set(re.findall(r"^([a-z_]+)\s*=", EXAMPLE.read_text(), flags=re.MULTILINE))
    assert keys <= set(ModelProfile.model_fields)
