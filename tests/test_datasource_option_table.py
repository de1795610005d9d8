"""Issue 47: docs/datasource.md's tables of Spark's own sink options ("Spark's options, sink by
sink") hold what the formats do: for each row, the format's sink is built from the row's option
and value (no Spark, no service) and is accepted where the table says "same", refused with a line
naming the option where it says "refused"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from twophase.config import BUILTIN_FORMATS
from twophase.datasource import data_source
from twophase.errors import ConfigurationError

REPO = Path(__file__).resolve().parent.parent
SECTION = "\n## Spark's options, sink by sink\n"
#: Every built-in format, read from the sinks' registry: each has its table.
SOURCES = {f"twophase-{kind}": data_source(kind) for kind in BUILTIN_FORMATS}
BASE = {
    "twophase-kafka": {"kafka.bootstrap.servers": "broker:9092", "checkpointlocation": "/tmp/ck"},
    "twophase-jdbc": {"url": "jdbc:postgresql://db/shop", "dbtable": "events", "checkpointlocation": "/tmp/ck"},
    "twophase-files": {"path": "/tmp/twophase-option-table-unused", "checkpointlocation": "/tmp/ck"},
}


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _value(text: str) -> str:
    if text == "(empty)":
        return ""
    m = re.fullmatch(r"`(.*)`", text)
    assert m, f"a tried value must be in backticks or (empty): {text!r}"
    return m.group(1)


def rows() -> list[tuple[str, str, str, dict[str, str], str]]:
    """(format name, option, format cell, options to build with, verdict) per row of the tables."""
    text = (REPO / "docs" / "datasource.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out = []
    for part in section.split("\n### ")[1:]:
        name = part.split("\n", 1)[0].strip()
        for line in part.splitlines():
            if not line.startswith("| `"):
                continue
            option_cell, fmt, tried, verdict = _cells(line)
            option = _value(option_cell)
            value_text, _, extra = tried.partition(" with ")
            options = {option.lower(): _value(value_text)}
            for pair in re.findall(r"`([^`=]+)=([^`]*)`", extra):
                options[pair[0].lower()] = pair[1]
            if name == "twophase-files":
                options.setdefault("format", fmt)
            out.append((name, option, fmt, options, verdict))
    return out


ROWS = rows()


def test_the_tables_cover_each_format_and_every_verdict_is_same_or_refused():
    assert {r[0] for r in ROWS} == set(SOURCES)
    assert len(ROWS) > 100
    assert all(v.startswith(("same", "refused")) for *_, v in ROWS), [r for r in ROWS if not
                                                                      r[-1].startswith(("same", "refused"))]


@pytest.mark.parametrize("name,option,fmt,options,verdict", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{r[3][r[1].lower()][:20]}" for r in ROWS])
def test_each_row_is_what_the_format_does(name, option, fmt, options, verdict):
    ds = SOURCES[name](dict(BASE[name], **options))
    if verdict.startswith("same"):
        ds._check_options()
        ds.build_sink()
    else:
        with pytest.raises(ConfigurationError) as e:
            ds._check_options()
            ds.build_sink()
        assert option.lower() in str(e.value).lower(), str(e.value)
