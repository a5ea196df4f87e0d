"""The README's performance figures are docs/BENCHMARKS.md's current tables: every row of the README's "How
fast" table is a row of those tables with the same figures, no other README line states a sync time, and every
row of the tables is consistent in itself (its ratio is its baseline over its sync, its raw file exists)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEY = ("route", "GPU", "model", "trainer, export")
FIGURES = ("sync", "baseline (same run)", "baseline / sync")
TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s)\b")


def section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no '## {heading}' section"
    return m.group(1)


def tables(text: str) -> list[dict[str, str]]:
    """Every row of every markdown table in `text`, as header -> cell (bold and code marks kept)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(c) <= {"-", " "} for c in cells):
            assert len(cells) == len(header), f"row with {len(cells)} cells under {len(header)} headers: {line}"
            rows.append(dict(zip(header, cells)))
    return rows


def number(cell: str) -> tuple[float, str]:
    """(value, unit) of a cell such as `**13.8 ms**`, `10.1 ms copy`, `4.10 s`, `0.73`."""
    m = re.search(r"(\d+(?:\.\d+)?) ?(ms|s)?\b", cell.replace("*", ""))
    assert m, f"no figure in {cell!r}"
    return float(m.group(1)), m.group(2) or ""


def seconds(cell: str) -> float:
    value, unit = number(cell)
    return value / 1e3 if unit == "ms" else value


@pytest.fixture(scope="module")
def current() -> list[dict[str, str]]:
    rows = tables(section((ROOT / "docs" / "BENCHMARKS.md").read_text(), "Current figures, one table per route"))
    assert len(rows) >= 8, rows
    return rows


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_every_readme_figure_is_the_tables(current, readme):
    by_key = {tuple(r[k] for k in KEY): r for r in current}
    assert len(by_key) == len(current), "two rows of the current tables share route, GPU, model and trainer"
    stated = tables(section(readme, "How fast"))
    assert stated, "the README's How fast section has no table"
    for row in stated:
        key = tuple(row[k] for k in KEY)
        assert key in by_key, f"README row {key} is in no current table of docs/BENCHMARKS.md"
        for col in FIGURES:
            assert row[col] == by_key[key][col], f"{key} {col}: README {row[col]!r}, BENCHMARKS {by_key[key][col]!r}"


def test_the_readme_states_sync_times_only_in_its_how_fast_table(readme):
    how_fast = section(readme, "How fast")
    prose = "\n".join(line for line in how_fast.splitlines() if not line.startswith("|"))
    assert not TIME.findall(prose), f"figures outside the How fast table: {TIME.findall(prose)}"
    elsewhere = readme.replace(how_fast, "")
    assert not TIME.findall(elsewhere), f"sync times outside How fast: {TIME.findall(elsewhere)}"


def test_each_current_row_holds_together(current):
    for row in current:
        sync, base, ratio = seconds(row["sync"]), seconds(row["baseline (same run)"]), number(row["baseline / sync"])[0]
        assert abs(base / sync - ratio) <= 0.01 + 0.01 * ratio, f"{row['route']} {row['GPU']} {row['model']}: {row}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        name = row["raw file"].strip("`")
        assert (ROOT / "bench" / "results" / name).is_file() or (
            ROOT / "bench" / "results" / "history" / name
        ).is_file(), f"raw file {name} of {row['route']} {row['GPU']} {row['model']} is not under bench/results/"


def test_the_checks_fail_on_a_disagreeing_figure(current, readme):
    """A README that says 13.3 ms where the table says 13.8 ms fails the comparison above."""
    row = next(r for r in tables(section(readme, "How fast")) if r["sync"] == "**13.8 ms**")
    wrong = readme.replace(f"| {row['sync']} |", "| **13.3 ms** |", 1)
    with pytest.raises(AssertionError, match="README '\\*\\*13.3 ms\\*\\*'"):
        test_every_readme_figure_is_the_tables(current, wrong)
