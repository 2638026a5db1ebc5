"""scripts/doc_links.py, scripts/layout_page.py and the tutorials' part of scripts/check_docs.py: a broken page link,
a broken anchor (by the site's rule and by GitHub's), a stale or a missing layout entry and a stale tutorial path
are each named in one line, and each fails the docs check."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from benchmark_modules import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
notebooks = load("notebooks", SCRIPTS)
doc_links = load("doc_links", SCRIPTS)
layout_page = load("layout_page", SCRIPTS)
check_docs = load("check_docs", SCRIPTS)


def test_the_repository_links_layout_page_and_tutorials_hold():
    assert doc_links.problems(ROOT) == []
    assert layout_page.problems(ROOT) == []
    assert check_docs.tutorial_problems(ROOT) == []


# ---- links and anchors -------------------------------------------------------------------------------------------


def test_slugs_follow_the_site_and_github():
    heading = "A -- B: `code<x>` [link](u.md) *em*"
    assert doc_links.site_slug(doc_links.plain_heading(heading)) == "a-b-codex-link-em"
    assert doc_links.github_slug(doc_links.plain_heading(heading)) == "a----b-codex-link-em"
    assert doc_links.site_slug("Ünïcode") == "unicode"
    assert doc_links.github_slug("Ünïcode") == "ünïcode"
    text = "# Set up\n\n## Set up\n\n## Set up_1\n\n## !!\n\nSet up\n------\n"
    site = doc_links.anchors(text, doc_links.SlugRule.SITE)
    github = doc_links.anchors(text, doc_links.SlugRule.GITHUB)
    assert site.ids == {"set-up", "set-up_1", "set-up_2", "_1", "set-up_3"}  # Python-Markdown's toc.unique
    assert github.ids == {"set-up", "set-up-1", "set-up_1", "", "set-up-2"}  # github-slugger


def _repository(tmp_path: Path) -> Path:
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text(
        '# Guide\n\n## Set up\n\n## Set up\n\n## A -- B: `code`\n\n<a id="here"></a>\n\n'
        "[twice](other.md#set-up_1), [here](#a-b-code), [html id](#here), [folder](design/), [top](../README.md),\n"
        "[readme](../README.md#install-it-1), [ref][r], [collapsed][], <other.md>, <https://example.com>,\n"
        "`[code span](nowhere.md)`, [line](../src.py#L2), [site](https://example.com/x.md#y), [mail](mailto:a@b.c).\n"
        "\n```python\n[fenced](nowhere.md)\n```\n\n[r]: other.md#set-up\n[collapsed]: design/\n"
        "[missing](missing.md) and [a wrong\nanchor](other.md#set-up-1), [github's](../README.md#install_it),\n"
        "[undefined][nothing], [far](../../outside.md), [line](../src.py#L9), [here](#nope).\n"
    )
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Set up\n\n## Set up\n\n```\n## Not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Project\n\n## Install it\n\n## Install it\n\n"
        "[docs](docs/other.md#set-up-1) [site's](docs/other.md#set-up_1)\n"
    )
    (tmp_path / "src.py").write_text("a = 1\nb = 2\n")
    return tmp_path


def test_broken_links_and_anchors_are_named_one_line_each(tmp_path):
    root = _repository(tmp_path)
    assert doc_links.problems(root) == [
        "README.md:7: [site's](docs/other.md#set-up_1): no heading 'set-up_1' in docs/other.md "
        "(anchors by GitHub's rule)",
        "docs/guide.md:21: [missing](missing.md): no file docs/missing.md",
        "docs/guide.md:21: [a wrong anchor](other.md#set-up-1): no heading 'set-up-1' in docs/other.md "
        "(anchors by the site's rule)",
        "docs/guide.md:22: [github's](../README.md#install_it): no heading 'install_it' in README.md "
        "(anchors by GitHub's rule)",
        "docs/guide.md:23: [undefined][nothing]: no definition of this reference ([ref]: target)",
        "docs/guide.md:23: [far](../../outside.md): ../../outside.md leads out of the repository",
        "docs/guide.md:23: [line](../src.py#L9): src.py has 2 lines, not 9",
        "docs/guide.md:23: [here](#nope): no heading 'nope' in docs/guide.md (anchors by the site's rule)",
    ]


def test_a_fence_never_closed_is_named():
    text = "# Page\n\n```\ncode\n``` text after a fence does not close it\n\n## Gone\n"
    assert doc_links.text_problems(ROOT, ROOT / "README.md", text, "page.md") == [
        "page.md:3: this code fence is never closed (a closing fence stands alone on its line)"
    ]
    assert "gone" not in doc_links.anchors(text, doc_links.SlugRule.SITE)


def test_the_tutorials_markdown_links_are_checked(tmp_path):
    (tmp_path / "tutorials").mkdir()
    (tmp_path / "README.md").write_text("# Readme\n")
    _notebook(tmp_path / "tutorials" / "01_x.ipynb", "[readme](../README.md#readme) [gone](../docs/gone.md)")
    assert doc_links.problems(tmp_path) == [
        "tutorials/01_x.ipynb:cell 0:1: [gone](../docs/gone.md): no file docs/gone.md"
    ]


# ---- the layout page ---------------------------------------------------------------------------------------------

_LAYOUT = """# Layout

```
persia_planner/                    the planner
  cli/          app (typer app) <-- train (persia train; `python -m x`), index.html
  planner, units    the pipeline; sizes
modules/ = persia_planner.modules  the runtime
  ps/           store (rows) <-- client | server <-- jobs
  hashing       splitmix64, not_a_module
  tiers/        cxl
benchmarks/   planner
```
"""


def _layout_tree(root: Path) -> None:
    for path in [
        "persia_planner/__init__.py",
        "persia_planner/planner.py",
        "persia_planner/units.py",
        "persia_planner/cli/__init__.py",
        "persia_planner/cli/__main__.py",
        "persia_planner/cli/app.py",
        "persia_planner/cli/train.py",
        "modules/__init__.py",
        "modules/hashing.py",
        "modules/ps/__init__.py",
        "modules/ps/store.py",
        "modules/ps/client.py",
        "modules/ps/server.py",
        "modules/ps/row_file.py",
    ]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text('"""A module."""\n')
    (root / "docs" / "design").mkdir(parents=True)
    (root / "docs" / "design" / "layout.md").write_text(_LAYOUT)


def test_stale_and_missing_layout_entries_are_named(tmp_path):
    _layout_tree(tmp_path)
    assert layout_page.problems(tmp_path) == [
        "docs/design/layout.md:5: persia_planner/cli/: 'index.html' is not a module name",
        "docs/design/layout.md:8: modules/ps/jobs.py is listed but does not exist",
        "docs/design/layout.md:10: modules/tiers/ is listed but does not exist",
        "docs/design/layout.md: modules/ps/row_file.py is not listed",
    ]


# ---- the tutorials' names ----------------------------------------------------------------------------------------


def _notebook(path: Path, markdown: str, code: str = "") -> None:
    cells = [{"cell_type": "markdown", "id": "m", "metadata": {}, "source": markdown.splitlines(keepends=True)}]
    cells.append({"cell_type": "code", "id": "c", "metadata": {}, "execution_count": None, "outputs": [],
                  "source": code.splitlines(keepends=True)})  # fmt: skip
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def test_stale_tutorial_paths_are_named_and_what_the_notebook_writes_is_not(tmp_path):
    (tmp_path / "persia_planner").mkdir()
    (tmp_path / "persia_planner" / "__init__.py").write_text("")
    (tmp_path / "persia_planner" / "units.py").write_text("def format_bytes(n):\n    pass\n")
    (tmp_path / "tutorials").mkdir()
    code = (
        "%matplotlib inline\n"
        "out = Path('tutorials/out')\n"
        "out.mkdir()\n"
        "(out / 'plan.json').write_text('{}')\n"
        "open('benchmarks/notes.txt', 'w').close()\n"
        "cmd = ['persia', 'train', '--log-dir', 'docs/logs']\n"
        "Path('modules/old.py').read_text()\n"
    )
    _notebook(
        tmp_path / "tutorials" / "01_x.ipynb",
        "See persia_planner/units.py, `persia_planner.units.format_bytes`, 01_x.ipynb and 02_y.ipynb.\n"
        "Stale: persia_planner/loop.py and `persia_planner.units.parse`. Written: tutorials/out/plan.json,\n"
        "benchmarks/notes.txt, docs/logs/metrics.jsonl.\n",
        code,
    )
    assert notebooks.written_paths(notebooks.cells(tmp_path / "tutorials" / "01_x.ipynb")) == {
        "tutorials/out",
        "tutorials/out/plan.json",
        "benchmarks/notes.txt",
        "docs/logs",
    }
    assert check_docs.tutorial_problems(tmp_path) == [
        "tutorials/01_x.ipynb:cell 0: persia_planner.units.parse: persia_planner.units defines no 'parse'",
        "tutorials/01_x.ipynb:cell 0: persia_planner/loop.py: no such file or directory",
        "tutorials/01_x.ipynb:cell 0: 02_y.ipynb: no such notebook in tutorials/",
        "tutorials/01_x.ipynb:cell 1: modules/old.py: no such file or directory",
    ]


# ---- each made on purpose fails the docs check ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def documents_copy(tmp_path_factory):
    """The repository with its documents copied (to break them) and its sources linked."""
    copy = tmp_path_factory.mktemp("repository")
    for name in ("README.md", "CONTRIBUTING.md", "mkdocs.yml", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    for name in ("docs", "tutorials", "benchmarks"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.ipynb_checkpoints"))
    for name in ("persia_planner", "modules", "scripts", "tests", "constraints"):
        (copy / name).symlink_to(ROOT / name, target_is_directory=True)
    return copy


def _main(root: Path, monkeypatch, capsys) -> tuple[int, list[str]]:
    monkeypatch.setattr(sys, "argv", ["check_docs.py", str(root)])
    code = check_docs.main()
    return code, capsys.readouterr().out.splitlines()


_BREAKAGES = {
    "a broken page link": (
        "docs/index.md",
        lambda text: text + "\n[the search](design/searching.md)\n",
        ": [the search](design/searching.md): no file docs/design/searching.md",
    ),
    "a broken anchor by the site's rule": (
        "docs/design/hybrid.md",
        lambda text: text + "\n[calibration](cost_model.md#calibrating)\n",
        "no heading 'calibrating' in docs/design/cost_model.md (anchors by the site's rule)",
    ),
    "a broken anchor by GitHub's rule": (
        "README.md",
        lambda text: text + "\n[how to run them](CONTRIBUTING.md#benchmark)\n",
        "no heading 'benchmark' in CONTRIBUTING.md (anchors by GitHub's rule)",
    ),
    "a stale layout entry": (
        "docs/design/layout.md",
        lambda text: text.replace("ps, ssd (one descriptor each;", "ps, ssd, cxl (one descriptor each;"),
        ": persia_planner/tiers/cxl.py is listed but does not exist",
    ),
    "a missing layout entry": (
        "docs/design/layout.md",
        lambda text: text.replace("row_file (rows on local disk), ", ""),
        "docs/design/layout.md: modules/ps/row_file.py is not listed",
    ),
    "a stale tutorial path": (
        "tutorials/02_hybrid_training.ipynb",
        lambda text: text.replace("persia_planner/modules/train/loop.py", "persia_planner/modules/loop.py"),
        "tutorials/02_hybrid_training.ipynb:cell 0: persia_planner/modules/loop.py: no such file or directory",
    ),
}


def test_the_documents_copy_passes(documents_copy, monkeypatch, capsys):
    assert _main(documents_copy, monkeypatch, capsys) == (0, [])


@pytest.mark.parametrize("breakage", list(_BREAKAGES))
def test_a_breakage_made_on_purpose_fails_the_docs_check(breakage, documents_copy, monkeypatch, capsys):
    name, edit, expected = _BREAKAGES[breakage]
    document = documents_copy / name
    before = document.read_text(encoding="utf-8")
    broken = edit(before)
    assert broken != before, "the breakage no longer applies to the document: update the test"
    document.write_text(broken, encoding="utf-8")
    try:
        code, lines = _main(documents_copy, monkeypatch, capsys)
    finally:
        document.write_text(before, encoding="utf-8")
    assert code == 1
    assert [line for line in lines if expected in line] != [], lines
    assert len(lines) == 1, lines


def test_a_comment_opener_in_a_code_span_hides_nothing_and_comments_and_footnotes_hold_no_links():
    text = (
        "Use `<!--` here [bad](missing.md) and `-->` there\n\n"
        "<!--\n\n[x](gone.md)\n\n-->\n\n"
        "A claim.[^1]\n\n[^1]: Measured on a quiet machine\n"
    )
    assert [link.target for link in doc_links.links(text)] == ["missing.md"]
