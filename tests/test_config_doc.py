"""docs/configuration.md is generated from the DASConfig schema: it must be what the generator prints now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from das.config import DASConfig
from integrations import config_doc

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"


def test_the_page_is_what_the_schema_generates():
    assert PAGE.read_text() == config_doc.render(), (
        "docs/configuration.md is stale: regenerate it with `python -m integrations.config_doc > docs/configuration.md`")


def test_every_setting_has_one_row_with_its_default():
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| `([^`]*)` \|", PAGE.read_text(), re.M))
    assert set(rows) == set(DASConfig.model_fields)
    for key, field in DASConfig.model_fields.items():
        assert rows[key] == config_doc.value_text(field.default), key


def test_evidence_names_settings_and_anchors_of_the_benchmarks_page():
    assert set(config_doc.EVIDENCE) <= set(DASConfig.model_fields)
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", (REPO / "docs" / "benchmarks.md").read_text(), re.M)}
    for key, (line, anchor) in config_doc.EVIDENCE.items():
        assert "\n" not in line and anchor in anchors, (key, anchor)


@pytest.mark.parametrize("key, want", [("window", "[1, inf)"), ("decay", "(0, 1]"), ("max_depth", "[2, 10000]"),
                                       ("c_base", "(0, inf), or null"), ("defer_global", "true, false, null"),
                                       ("chooser", "`mix`, `walk`")])
def test_ranges_come_from_the_schema(key, want):
    assert config_doc.range_text(key) == want
