"""The site's home page, its results index and the figures the README quotes: the home page guides to every page
of the site and shows the README's tables by inclusion, never as a copy; the results index lists every dated page
and says which kept their files; the README's figures are those of the files behind them."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
HOME = (DOCS / "index.md").read_text()
RESULTS_INDEX = (DOCS / "results" / "index.md").read_text()


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


NAV = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
INCLUDED = re.findall(r'^--8<-- "README\.md:([\w-]+)"$', HOME, flags=re.M)


def _links(text: str) -> set[str]:
    return {target.partition("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)}


def _readme_section(name: str) -> str:
    match = re.search(rf"<!-- --8<-- \[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\] -->", README, flags=re.S)
    assert match, f"README.md has no section {name!r} (<!-- --8<-- [start:{name}] --> ... [end:{name}])"
    return match.group(1)


def _table_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return [row for row in rows[2:]]  # without the header and its rule


# -- the home page ---------------------------------------------------------------------------------------------------
def test_the_home_page_is_not_the_readme():
    assert HOME != README and "## Quick starts" not in HOME
    assert len(HOME.splitlines()) < len(README.splitlines())


def test_the_home_page_links_every_guide_and_reference_page_of_the_site():
    expected = {page for page in NAV if page != "index.md" and not page.startswith("results/")} | {"results/index.md"}
    assert expected - _links(HOME) == set()


def test_the_home_page_map_follows_the_path_from_a_first_run_to_the_reference():
    site_map = HOME.split("## A map of this site", 1)[1]
    order = ["installation.md", "training.md", "high-resolution.md", "fine-tuning.md", "prediction.md",
             "benchmark.md", "backends.md", "timm.md", "configuration.md", "reference/ops.md"]
    positions = [site_map.index(f"]({page})") for page in order]
    assert positions == sorted(positions)


def test_the_home_page_includes_the_readmes_tables_and_copies_none():
    assert INCLUDED == ["which-type", "gpu", "results"]
    assert all(_table_rows(_readme_section(name)) for name in INCLUDED)
    # a table written into the home page could drift from the README's; included, it cannot
    assert not [line for line in HOME.splitlines() if line.startswith("|")]
    assert not re.search(r"\d+\.\d+%", HOME)


def test_the_home_page_shows_the_picture_the_readme_shows():
    (picture,) = re.findall(r"!\[[^\]]*\]\(docs/([^)]+)\)", README)
    assert f"]({picture})" in HOME and (DOCS / picture).is_file()


# -- the README's figures against their files ------------------------------------------------------------------------
def test_the_readmes_results_table_is_the_files_table():
    files = {row[0]: row for row in _table_rows((DOCS / "tables" / "cluttered-digits-e16.md").read_text())}
    readme = _table_rows(_readme_section("results"))
    assert len(readme) >= 5
    for name, accuracy, memory in readme:
        row = files[name.replace("`", "")]
        assert (accuracy, memory) == (row[1], row[4]), name


def test_the_readmes_main_job_figures_are_its_summary_files():
    match = re.search(r"test accuracy (\d+\.\d+)% \(seed 0: (\d+) of the (\d+) test digits\), (\d+) to\s+(\d+) s", README)
    assert match, "the README's main job sentence"
    summaries = [json.loads(path.read_text()) for path in sorted((DOCS / "results" / "2026-11-27-main-job-files").glob("*/summary.json"))]
    assert len(summaries) == 2
    for summary in summaries:
        assert f"{100 * summary['test_acc']:.2f}" == match.group(1)
        assert (round(summary["test_acc"] * summary["test_samples"]), summary["test_samples"]) == (int(match.group(2)), int(match.group(3)))
    walls = sorted(round(s["wall_time_s"]) for s in summaries)
    assert walls == [int(match.group(4)), int(match.group(5))]


def test_the_python_version_the_pages_name_is_the_packages():
    required = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    named = {version for page in [REPO / "README.md", *DOCS.glob("*.md")]
             for version in re.findall(r"Python ≥ (3\.\d+)", page.read_text())}
    assert named == {required.removeprefix(">=")}


# -- the results index -----------------------------------------------------------------------------------------------
RESULT_PAGES = sorted(p.name for p in (DOCS / "results").glob("*.md") if p.name != "index.md")
INDEX_ROWS = {row[1].split("](")[1].rstrip(")"): row for row in _table_rows(RESULTS_INDEX)}


def test_the_results_index_lists_every_dated_page_newest_first_as_the_nav_does():
    listed = list(INDEX_ROWS)
    assert sorted(listed) == RESULT_PAGES
    assert [row[0] for row in INDEX_ROWS.values()] == sorted((row[0] for row in INDEX_ROWS.values()), reverse=True)
    assert [page for page in NAV if page.startswith("results/2")] == [f"results/{page}" for page in listed]
    for page, row in INDEX_ROWS.items():
        assert page.startswith(row[0]), page


@pytest.mark.parametrize("page", RESULT_PAGES)
def test_the_results_index_says_which_pages_kept_their_files(page):
    text = (DOCS / "results" / page).read_text()
    (files_line,) = re.findall(r"^- \*\*Files behind it:\*\* (.*)$", text, flags=re.M)
    kept = not files_line.startswith("none kept")
    assert INDEX_ROWS[page][3].startswith("none kept") != kept, page
    assert "no file behind" not in text  # a figure without its files is not published, not flagged
