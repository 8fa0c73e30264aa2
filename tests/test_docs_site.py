"""The site's home page, its generated parts, its results index and the figures the README quotes: the home page
guides to every page of the site and shows the README's tables as generated copies; every generated part of a page
is what scripts/docs_hooks.py generates now, so a page reads on a repository page as on the site; every results page
opens with its topic and status, and the results index, generated from them, lists each page once under its topic
and says which are current and which kept their files; the README's figures are those of the files behind them."""
from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.helpers import load_script
from visattn.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
HOME = (DOCS / "index.md").read_text()
RESULTS_INDEX = (DOCS / "results" / "index.md").read_text()
HOOKS = load_script("docs_hooks")
DRAW_MASKS = load_script("draw_masks")


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


NAV = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
GENERATED_IN_HOME = {match["name"]: match["body"] for match in HOOKS.REGION.finditer(HOME)}


def _links(text: str) -> set[str]:
    return {target.partition("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)}


def _readme_section(name: str) -> str:
    match = re.search(rf"<!-- section: {name} -->\n(.*?)<!-- end section: {name} -->", README, flags=re.S)
    assert match, f"README.md has no section {name!r} (<!-- section: {name} --> ... <!-- end section: {name} -->)"
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


def test_the_home_page_shows_the_readmes_tables_as_generated_copies_and_writes_none_by_hand():
    assert list(GENERATED_IN_HOME) == ["readme:which-type", "readme:gpu", "readme:results"]
    for name, body in GENERATED_IN_HOME.items():
        section = _readme_section(name.removeprefix("readme:"))
        assert _table_rows(section) and body.strip() == section.strip(), name
    # a table written by hand into the home page could drift from the README's; generated, a test keeps it equal
    by_hand = HOOKS.REGION.sub("", HOME)
    assert not [line for line in by_hand.splitlines() if line.startswith("|")]
    assert not re.search(r"\d+\.\d+%", by_hand)


def test_the_home_page_shows_the_picture_the_readme_shows():
    (picture,) = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    from_docs = picture.removeprefix("docs/") if picture.startswith("docs/") else f"../{picture}"
    assert f"]({from_docs})" in HOME and (REPO / picture).is_file()


# -- the README's figures against their files ------------------------------------------------------------------------
def test_the_readmes_results_tables_are_the_files_tables():
    """Every accuracy of the README's tuning and held-out tables is its file's: linear's from the table of the
    recipe's 8-epoch first stage, axial's from the table of its 16-epoch one."""
    files = {"linear": "cluttered-digits-maxpool-3seeds.md", "axial": "cluttered-digits-maxpool-axial16.md"}
    accuracy = {
        (row[0], attn): row[3]
        for attn, name in files.items()
        for row in _table_rows((REPO / "results" / "tables" / name).read_text())
        if row[2] == attn
    }
    tables = [block for block in _readme_section("results").split("\n\n") if block.startswith("|")]
    assert [block.splitlines()[0] for block in tables] == [
        "| tuning variant | `linear` | `axial` |", "| held-out variant | `linear` | `axial` |",
    ]
    for block in tables:
        rows = _table_rows(block)
        assert len(rows) == 3
        for variant, *cells in rows:
            name = variant.split("`")[1]
            assert cells == [accuracy[name, "linear"], accuracy[name, "axial"]], name


def test_the_readmes_main_job_figures_are_its_summary_files():
    match = re.search(r"test accuracy (\d+\.\d+)% \(seed 0: (\d+) of the (\d+) test digits\), (\d+) to\s+(\d+) s", README)
    assert match, "the README's main job sentence"
    summaries = [json.loads(path.read_text()) for path in sorted((REPO / "results" / "2026-11-28-main-job").glob("*/summary.json"))]
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


# -- the generated parts -------------------------------------------------------------------------------------------
GENERATED_PAGES = HOOKS.generated_pages(DOCS)


def test_the_generated_parts_are_the_config_table_the_readmes_tables_the_results_index_and_the_pictures():
    names = {match["name"] for page in GENERATED_PAGES for match in HOOKS.REGION.finditer(page.read_text())}
    assert names == {"trainconfig-fields", "readme:which-type", "readme:gpu", "readme:results", "results-index",
                     "mask-pictures"}


@pytest.mark.parametrize("page", GENERATED_PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_every_generated_part_is_what_the_hook_generates_now(page):
    text = page.read_text()
    stale = f"{page.relative_to(REPO)} is out of date: python scripts/docs_hooks.py rewrites it"
    assert HOOKS.refresh(text) == text, stale


@pytest.mark.parametrize("page, edit", [
    ("results/index.md", lambda text: text.replace("| **current** |", "| current |", 1)),
    ("configuration.md", lambda text: re.sub(r"^\| `seed` .*\n", "", text, flags=re.M)),
    ("index.md", lambda text: text.replace("| timm (flash attention) |", "| timm |", 1)),
])
def test_a_stale_generated_part_is_written_afresh(page, edit):
    text = (DOCS / page).read_text()
    stale = edit(text)
    assert stale != text and HOOKS.refresh(stale) == text


def test_the_configuration_reference_lists_every_trainconfig_field():
    keys = re.findall(r"^\| `(\w+)` \| `--", (DOCS / "configuration.md").read_text(), flags=re.M)
    assert keys == [field.name for field in dataclasses.fields(TrainConfig)]


def _readme_doc_links() -> list[str]:
    return sorted({target.partition("#")[0] for target in re.findall(r"\]\((docs/[^)\s]+\.md)(?:#[^)]*)?\)", README)})


@pytest.mark.parametrize("target", _readme_doc_links())
def test_every_page_the_readme_links_reads_on_a_repository_page(target):
    text = (REPO / target).read_text()
    assert "--8<--" not in text, f"{target} holds a snippet marker"
    assert not re.search(r"^:::", text, flags=re.M), f"{target} holds a directive that only the site expands"
    assert all(match["body"].strip() for match in HOOKS.REGION.finditer(text)), f"{target}: an empty generated part"


def test_the_changelog_page_links_the_changelog_and_the_site_shows_it_there():
    assert "](../CHANGELOG.md)" in (DOCS / "changelog.md").read_text()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="changelog.md"))
    shown = HOOKS.on_page_markdown("", page, {"docs_dir": str(DOCS)}, None)
    assert shown == (REPO / "CHANGELOG.md").read_text()


# -- the results pages and their index -------------------------------------------------------------------------------
RESULT_PAGES = sorted(p.name for p in (DOCS / "results").glob("*.md") if p.name != "index.md")
# each row of the index by its page: date, page, status, machine, files
INDEX_ROWS = {
    row[1].split("](")[-1].rstrip(")"): row for row in _table_rows(RESULTS_INDEX) if re.match(r"\d{4}-", row[0])
}
# the pages listed under each topic's heading, in their order
INDEX_TOPICS = {
    topic: re.findall(r"^\| \d{4}-\d\d-\d\d \| \[.*?\]\(([\w-]+\.md)\)", body, flags=re.M)
    for topic, body in re.findall(r"^## (.+)\n((?:\n|\|.*\n)*)", RESULTS_INDEX, flags=re.M)
}


def _page(name: str):
    return HOOKS.read_results_page(DOCS / "results" / name)


@pytest.mark.parametrize("page", RESULT_PAGES)
def test_every_results_page_opens_with_its_topic_and_status(page):
    header = (DOCS / "results" / page).read_text().splitlines()[:4]
    assert header[2].startswith("- **Topic:** ") and header[3].startswith("- **Status:** "), header
    result = _page(page)
    assert result.topic and (result.status == "current") != bool(result.successors)


def test_a_page_without_its_opening_lines_is_refused(tmp_path):
    page = tmp_path / "2026-01-01-example.md"
    rest = "- **Machine:** 2-core CPU\n- **Files behind it:** none kept\n"
    page.write_text("# Example\n\n- **Date:** 2026-01-01\n" + rest)
    with pytest.raises(ValueError, match="Topic"):
        HOOKS.read_results_page(page)
    page.write_text("# Example\n\n- **Topic:** x\n- **Status:** old\n" + rest)
    with pytest.raises(ValueError, match="Status must be"):
        HOOKS.read_results_page(page)


@pytest.mark.parametrize("page", [name for name in RESULT_PAGES if _page(name).successors])
def test_a_superseded_page_links_at_its_top_later_pages_that_lead_to_a_current_one(page):
    seen, frontier = set(), {page}
    while frontier:
        name = frontier.pop()
        seen.add(name)
        for successor in _page(name).successors:
            assert successor in RESULT_PAGES and successor != name, (name, successor)
            assert successor[:10] >= name[:10], f"{name} is superseded by the older {successor}"
            frontier |= {successor} - seen
    assert any(not _page(name).successors for name in seen), f"{page}: no current page at the end of its successors"


def test_the_results_index_lists_every_page_once_under_its_topic_newest_first():
    listed = [name for names in INDEX_TOPICS.values() for name in names]
    assert sorted(listed) == RESULT_PAGES
    for page, row in INDEX_ROWS.items():
        assert page.startswith(row[0]), page
    for topic, names in INDEX_TOPICS.items():
        assert {_page(name).topic for name in names} == {topic}
        assert [name[:10] for name in names] == sorted((name[:10] for name in names), reverse=True), topic


def test_the_results_index_marks_each_topics_current_pages_and_links_the_successors_of_the_others():
    for topic, names in INDEX_TOPICS.items():
        assert any(INDEX_ROWS[name][2] == "**current**" for name in names), f"{topic}: no current page"
    for page, row in INDEX_ROWS.items():
        successors = _page(page).successors
        assert (row[2] == "**current**") == (not successors), page
        assert re.findall(r"\]\(([\w-]+\.md)\)", row[2]) == list(successors), page


def test_the_nav_takes_the_results_pages_through_their_index_alone():
    assert [page for page in NAV if page.startswith("results/")] == ["results/index.md"]


@pytest.mark.parametrize("page", RESULT_PAGES)
def test_the_results_index_says_which_pages_kept_their_files(page):
    text = (DOCS / "results" / page).read_text()
    (files_line,) = re.findall(r"^- \*\*Files behind it:\*\* (.*)$", text, flags=re.M)
    kept = not files_line.startswith("none kept")
    assert INDEX_ROWS[page][4].startswith("none kept") != kept, page
    assert "no file behind" not in text  # a figure without its files is not published, not flagged


# -- the pictures of the attention types -----------------------------------------------------------------------------
def _keys(name: str) -> torch.Tensor:
    """What the picture of ``name`` draws for its two queries, the prefix tokens first, one row per query."""
    H, W = DRAW_MASKS.GRID
    picture = DRAW_MASKS.PICTURES[name]
    return torch.stack([picture.keys(row * W + col) for row, col in ((H // 2, W // 2 - 2), (1, W - 2))])


def test_every_type_has_a_picture_of_its_own():
    pictures = {path.stem: path.read_bytes() for path in (DOCS / "img" / "masks").glob("*.png")}
    assert set(pictures) == set(DRAW_MASKS.PICTURES)
    assert len(set(pictures.values())) == len(pictures), "two pictures are the same file"


def test_no_two_types_are_drawn_alike():
    drawn = {name: _keys(name) for name in DRAW_MASKS.PICTURES}
    for first in drawn:
        for second in drawn:
            if first < second:
                alike = drawn[first].shape == drawn[second].shape and torch.equal(drawn[first], drawn[second])
                assert not alike, f"{first} and {second} are drawn alike"


def test_the_pictures_show_the_prefix_tokens_each_type_reads():
    prefix, grid = DRAW_MASKS.PREFIX, DRAW_MASKS.GRID
    read = {name: bool(_keys(name)[:, :prefix].gt(0).all()) for name in DRAW_MASKS.PICTURES}
    assert read == {"softmax": True, "linear": True, "linear-decay": True, "neighborhood": False, "sparse": False,
                    "neighborhood-tile-aligned": False, "sparse-tile-aligned": False, "sparse-tile-aligned-halo0": False,
                    "longformer": True, "linformer": True, "axial": True, "floor": False}
    global_tokens = DRAW_MASKS.PICTURES["longformer"].prefix
    assert global_tokens > prefix and _keys("longformer").shape[1] == global_tokens + grid[0] * grid[1]
    assert _keys("longformer")[:, :global_tokens].eq(1).all()


def test_linear_is_drawn_as_every_key_with_its_locality_term_on_top():
    keys = _keys("linear")[0, DRAW_MASKS.PREFIX:].view(DRAW_MASKS.GRID)
    row, col = DRAW_MASKS.GRID[0] // 2, DRAW_MASKS.GRID[1] // 2 - 2
    darker = keys.eq(1).nonzero().tolist()
    assert sorted(darker) == sorted([[r, c] for r in range(row - 1, row + 2) for c in range(col - 1, col + 2)])
    assert keys.gt(0).all()
