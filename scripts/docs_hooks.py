"""The documentation's generated parts: an mkdocs hook, and the command that writes them into the pages.

Four kinds of content are generated rather than written by hand: the configuration reference's table (from
TrainConfig's fields), the home page's tables (the README's sections of the same names), the results index (from the
Topic and Status lines that open every results page) and the Attention types page's table of pictures (from
scripts/draw_masks.py's PICTURES, with the call that draws each). Each is committed between two markers,

    <!-- generated: NAME (scripts/docs_hooks.py) -->
    ...
    <!-- end generated: NAME -->

so that a page reads the same on a repository page as on the built site. At every build this hook writes each
part afresh; tests/test_docs_site.py fails while a committed copy differs from what it generates:

    python scripts/docs_hooks.py           # rewrite the generated parts that are out of date
    python scripts/docs_hooks.py --check   # name them, exit status 1 if any

The site's changelog page is CHANGELOG.md itself, put at build time in place of docs/changelog.md, which on a
repository page links to it.

The run outputs behind the results pages (tables, benchmark reports, run files) live outside docs/, in the
repository's results/ folder. A page links to them by their place in the repository (``../results/...`` from docs/,
``../../results/...`` from docs/results/), which works on a repository page; the hook adds every file of results/ to
the site under that same link, served at ``results/...`` beside the results pages, so the links work there too.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from visattn.train.config import TrainConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
RESULTS = "results"  # the run outputs' folder, beside docs/
REGION = re.compile(
    r"(?P<start><!-- generated: (?P<name>[\w:-]+) \(scripts/docs_hooks\.py\) -->\n)(?P<body>.*?)"
    r"(?P<end><!-- end generated: (?P=name) -->)",
    flags=re.S,
)


# -- the configuration reference -------------------------------------------------------------------------------------
def _default(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    return "none" if value is None else f"`{value!r}`".replace("|", "\\|")


def config_table() -> str:
    """One row per TrainConfig field: key, flag, type, default, help."""
    rows = ["| key | flag | type | default | what |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(TrainConfig):
        type_name = str(field.type).replace("|", "or")
        help_text = field.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | `--{field.name.replace('_', '-')}` | `{type_name}` | {_default(field)} | {help_text} |")
    return "\n".join(rows) + "\n"


# -- the README's sections -------------------------------------------------------------------------------------------
def readme_section(readme: str, name: str) -> str:
    """The README's text between ``<!-- section: NAME -->`` and ``<!-- end section: NAME -->``, its links to
    ``docs/...`` and ``results/...`` made relative to docs/; ValueError if there is no such section."""
    match = re.search(rf"<!-- section: {name} -->\n(.*?)<!-- end section: {name} -->", readme, flags=re.S)
    if match is None:
        raise ValueError(f"README.md has no section {name!r} "
                         f"(<!-- section: {name} --> ... <!-- end section: {name} -->)")
    # the run outputs first: docs/results/ (the results pages) becomes results/ too
    return match.group(1).replace(f"]({RESULTS}/", f"](../{RESULTS}/").replace("](docs/", "](")


# -- the results index -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResultsPage:
    """What the index says of one dated results page, read from its opening lines."""

    name: str  # file name, docs/results/<date>-<slug>.md
    title: str
    topic: str
    status: str  # "current", or "superseded by" and links
    successors: tuple[str, ...]  # file names of the pages that superseded it; empty when current
    machine: str
    files: str

    @property
    def date(self) -> str:
        return self.name[:10]


def _field(text: str, key: str) -> str | None:
    """A header field ``- **Key:** value``, its indented continuation lines joined, or None."""
    match = re.search(rf"^- \*\*{key}:\*\* (.*(?:\n  .*)*)", text, flags=re.M)
    return None if match is None else " ".join(line.strip() for line in match.group(1).splitlines())


def read_results_page(path: Path) -> ResultsPage:
    """The page's title, Topic and Status (the two lines right after its title) and its Machine and Files lines;
    ValueError naming the page and what is missing."""
    text = path.read_text()
    lines = text.splitlines()
    if len(lines) < 4 or not lines[0].startswith("# ") or lines[1] or not lines[2].startswith("- **Topic:** ") \
            or not lines[3].startswith("- **Status:** "):
        raise ValueError(f"{path.name}: its title must be followed by a blank line, `- **Topic:** ...` and "
                         "`- **Status:** current` or `- **Status:** superseded by [...](<page>.md) ...`")
    status = _field(text, "Status")
    successors: tuple[str, ...] = ()
    if status.startswith("superseded by ["):
        successors = tuple(dict.fromkeys(re.findall(r"\]\((\d{4}-\d\d-\d\d-[\w-]+\.md)\)", status)))
    if status != "current" and not successors:
        raise ValueError(f"{path.name}: Status must be `current` or `superseded by` links to results pages, "
                         f"got {status!r}")
    machine, files = _field(text, "Machine"), _field(text, "Files behind it")
    if machine is None or files is None:
        raise ValueError(f"{path.name}: needs a `- **Machine:**` and a `- **Files behind it:**` line")
    return ResultsPage(path.name, lines[0][2:].strip(), _field(text, "Topic"), status, successors, machine, files)


def results_pages(results_dir: Path) -> list[ResultsPage]:
    return [read_results_page(path) for path in sorted(results_dir.glob("2*.md"))]


def _machine(page: ResultsPage) -> str:
    kinds = [kind for kind in ("H200", "2-core CPU") if kind in page.machine]
    return ", ".join(kinds) or page.machine


def _files(page: ResultsPage) -> str:
    if page.files.startswith("none kept"):
        return "none kept"
    return "some" if "none kept" in page.files else "yes"


def _steps_to_current(page: ResultsPage, by_name: dict[str, ResultsPage]) -> int:
    """How many successions separate the page from a current one (0 for a current page)."""
    steps, frontier, seen = 0, {page.name}, set()
    while frontier and not any(not by_name[name].successors for name in frontier):
        seen |= frontier
        frontier = {successor for name in frontier for successor in by_name[name].successors} - seen
        steps += 1
    return steps


def results_index(results_dir: Path) -> str:
    """One table per topic, the topics with the newest pages first; in each, newest first and, on one day, the
    current page before the pages it superseded."""
    pages = results_pages(results_dir)
    by_name = {page.name: page for page in pages}
    for page in pages:
        unknown = [name for name in page.successors if name not in by_name]
        if unknown:
            raise ValueError(f"{page.name}: superseded by {', '.join(unknown)}, which is not a results page")
    topics: dict[str, list[ResultsPage]] = {}
    for page in pages:
        topics.setdefault(page.topic, []).append(page)
    def newest_first(date: str) -> int:
        return -int(date.replace("-", ""))

    order = sorted(topics, key=lambda topic: (newest_first(max(p.date for p in topics[topic])), topic))
    out = []
    for topic in order:
        out += [f"## {topic}", "", "| date | page | status | machine | files |", "|---|---|---|---|---|"]
        rows = sorted(topics[topic], key=lambda p: (newest_first(p.date), _steps_to_current(p, by_name), p.name))
        for page in rows:
            if page.successors:
                status = "superseded by " + ", ".join(f"[{name[:-3]}]({name})" for name in page.successors)
            else:
                status = "**current**"
            title = page.title.replace("|", "\\|")
            out.append(f"| {page.date} | [{title}]({page.name}) | {status} | {_machine(page)} | {_files(page)} |")
        out.append("")
    return "\n".join(out)


# -- the pictures of the attention types -----------------------------------------------------------------------------
def _script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (scripts/ is no package), registered where its dataclasses look
    their module up."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- the generated parts ---------------------------------------------------------------------------------------------
README_SECTIONS = ("which-type", "gpu", "results")


def generators(docs: Path) -> dict[str, Callable[[], str]]:
    readme = (docs.parent / "README.md").read_text()
    return {
        "trainconfig-fields": config_table,
        **{f"readme:{name}": (lambda name=name: readme_section(readme, name)) for name in README_SECTIONS},
        "results-index": lambda: results_index(docs / "results"),
        "mask-pictures": lambda: _script("draw_masks").caption_table(),
    }


def refresh(text: str, docs: Path = DOCS) -> str:
    """``text`` with every generated part written afresh; ValueError for a part of unknown name."""
    made = generators(docs)

    def fill(match: re.Match) -> str:
        if match["name"] not in made:
            raise ValueError(f"unknown generated part {match['name']!r}; known: {', '.join(made)}")
        # blank lines around the part: a Markdown block must not touch the HTML comments
        return match["start"] + "\n" + made[match["name"]]().strip("\n") + "\n\n" + match["end"]

    return REGION.sub(fill, text)


def generated_pages(docs: Path = DOCS) -> list[Path]:
    return [path for path in sorted(docs.rglob("*.md")) if REGION.search(path.read_text())]


def results_files(docs: Path) -> list[tuple[str, str]]:
    """(the path a page's link resolves to, relative to ``docs``; where the site serves it) for every file under
    results/: ``../results/tables/x.csv`` is served at ``results/tables/x.csv``."""
    root = docs.parent / RESULTS
    files = sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())
    return [(f"../{RESULTS}/{name}", f"{RESULTS}/{name}") for name in files]


def on_files(files, config):
    """The files under results/ added to the site; ValueError where one would be served in a page's place."""
    from mkdocs.structure.files import File, InclusionLevel

    docs = Path(config["docs_dir"])
    served = {file.dest_uri for file in files}
    for link, dest in results_files(docs):
        file = File(link, str(docs), config["site_dir"], config["use_directory_urls"])
        if file.is_documentation_page():  # a generated table or report: a page of the site, at its own URL
            dest = file.dest_uri.replace(f"../{RESULTS}/", f"{RESULTS}/", 1)
        if dest in served:
            raise ValueError(f"{link} would be served at {dest}, where the site has a page already")
        # INCLUDED: a path that starts with "." (here "../") is otherwise taken for a hidden file and left out
        files.append(File(link, str(docs), config["site_dir"], config["use_directory_urls"], dest_uri=dest,
                          inclusion=InclusionLevel.INCLUDED))
        served.add(dest)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        return (Path(config["docs_dir"]).parent / "CHANGELOG.md").read_text()
    return refresh(markdown, Path(config["docs_dir"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the documentation's generated parts into its pages.")
    parser.add_argument("--check", action="store_true",
                        help="only name the pages whose generated parts are out of date")
    args = parser.parse_args(argv)
    stale = [path for path in generated_pages() if refresh(path.read_text()) != path.read_text()]
    for path in stale:
        if not args.check:
            path.write_text(refresh(path.read_text()))
        print(f"{'out of date' if args.check else 'rewrote'}: {path.relative_to(DOCS.parent)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
