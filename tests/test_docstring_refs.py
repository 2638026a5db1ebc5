"""scripts/docstring_refs.py: every docstring cross-reference resolves as Sphinx's Python domain resolves it, and a
broken one is named with its line (and fails scripts/check_docs.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from benchmark_modules import load

ROOT = Path(__file__).resolve().parents[1]
docstring_refs = load("docstring_refs", ROOT / "scripts")
check_docs = load("check_docs", ROOT / "scripts")
Scope = docstring_refs.Scope

PLANNER = '''"""Plans: :class:`Planner`, :data:`LIMIT`."""

from dataclasses import dataclass

import numpy as np

LIMIT = 3
SIZE: int = 4


class Base:
    def shared(self):
        pass


@dataclass
class Planner(Base):
    """Runs :meth:`run`, then
    :meth:`.no_such_method`."""

    budget: int = 0

    def run(self):
        """Sets :attr:`seen`; see :func:`!unchecked` and :func:`persia_planner.planner.nothing`."""
        self.seen = np.zeros(1)


def plan():
    """:func:`~persia_planner.planner.plan` with a :class:`.store.Store` (:mod:`.ps`), :class:`np.ndarray`."""
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small project: persia_planner/ (with a re-export), modules/ps/ (with lazily exported names), a benchmark."""
    files = {
        "persia_planner/__init__.py": "from persia_planner.planner import plan\n",
        "persia_planner/planner.py": PLANNER,
        "modules/__init__.py": "",
        "modules/ps/__init__.py": '_HOMES = {"Store": "persia_planner.modules.ps.store"}\n',
        "modules/ps/store.py": 'class Store:\n    """A store."""\n\n    def take(self):\n        pass\n',
        "benchmarks/fuzz.py": 'def target():\n    """:func:`target` of :mod:`fuzz`."""\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "persia_planner" / "modules").symlink_to("../modules")  # as in the repository: not read twice
    return tmp_path


def test_the_sources_docstrings_reference_only_what_exists():
    assert docstring_refs.problems(ROOT) == []


def test_a_broken_reference_is_named_with_its_line(tree):
    assert docstring_refs.problems(tree) == [
        "persia_planner/planner.py:19: :meth:`.no_such_method`: no such name (looked in module persia_planner.planner)",
        "persia_planner/planner.py:24: :func:`persia_planner.planner.nothing`: no such name (looked in module "
        "persia_planner.planner)",
    ]
    assert len(docstring_refs.references(tree)) == 13  # `!unchecked` is read, and not checked


def test_a_full_name_resolves_through_re_exports(tree):
    objects = docstring_refs.index(tree)
    anywhere = Scope("persia_planner.modules.ps.store")
    assert objects.resolve("persia_planner.planner.Planner", anywhere) == "persia_planner.planner.Planner"
    assert objects.resolve("persia_planner.modules.ps.store", anywhere) == "persia_planner.modules.ps.store"
    assert objects.resolve("persia_planner.plan", anywhere) == "persia_planner.planner.plan"  # imported in __init__
    assert objects.resolve("persia_planner.modules.ps.Store", anywhere) == "persia_planner.modules.ps.store.Store"
    assert (
        objects.resolve("persia_planner.modules.ps.Store.take", anywhere)
        == "persia_planner.modules.ps.store.Store.take"
    )
    assert objects.resolve("persia_planner.planner.Planer", anywhere) is None


def test_a_leading_dot_searches_the_module_then_every_name_ending_so(tree):
    objects = docstring_refs.index(tree)
    planner = Scope("persia_planner.planner")
    assert objects.resolve(".LIMIT", planner) == "persia_planner.planner.LIMIT"
    assert objects.resolve(".store.Store", planner) == "persia_planner.modules.ps.store.Store"
    assert objects.resolve(".Store.take", planner) == "persia_planner.modules.ps.store.Store.take"
    assert objects.resolve(".ps", planner) == "persia_planner.modules.ps"
    assert objects.resolve(".tore.Store", planner) is None  # a suffix of whole parts
    assert objects.resolve(".dataclasses", planner) is None  # ours, never another library's


def test_a_bare_name_searches_the_class_then_the_module_then_full_names(tree):
    objects = docstring_refs.index(tree)
    in_planner = Scope("persia_planner.planner", ("Planner",))
    assert objects.resolve("run", in_planner) == "persia_planner.planner.Planner.run"
    assert objects.resolve("SIZE", in_planner) == "persia_planner.planner.SIZE"  # an annotated assignment
    assert objects.resolve("Planner", in_planner) == "persia_planner.planner.Planner"
    assert objects.resolve("persia_planner.modules.ps", in_planner) == "persia_planner.modules.ps"
    assert objects.resolve("run", Scope("persia_planner.planner")) is None  # outside the class
    assert objects.resolve("take", in_planner) is None  # another module's


def test_a_class_member_is_a_method_field_attribute_set_on_self_or_inherited(tree):
    objects = docstring_refs.index(tree)
    planner = Scope("persia_planner.planner")
    assert objects.resolve("Planner.run", planner) == "persia_planner.planner.Planner.run"
    assert objects.resolve("Planner.budget", planner) == "persia_planner.planner.Planner.budget"
    assert objects.resolve("Planner.seen", planner) == "persia_planner.planner.Planner.seen"
    assert objects.resolve("Planner.shared", planner) == "persia_planner.planner.Base.shared"
    assert objects.resolve("Planner.budgets", planner) is None


def test_another_librarys_name_is_accepted_unchecked(tree):
    objects = docstring_refs.index(tree)
    planner = Scope("persia_planner.planner")
    assert objects.resolve("torch.nn.Module", planner) == "torch.nn.Module"
    assert objects.resolve("os.path.samefile", planner) == "os.path.samefile"
    assert objects.resolve("ValueError", planner) == "ValueError"
    assert objects.resolve("np.ndarray", planner) == "numpy.ndarray"  # what the module imports as np
    assert objects.resolve("Tensor", planner) is None


def test_a_name_of_one_of_our_modules_is_ours_even_where_the_standard_library_has_one(tree):
    """modules/ps/store.py and modules/data/profile.py are the project's: ``profile.typo`` is a broken reference to
    ours, not the standard library's ``profile`` module."""
    (tree / "modules" / "ps" / "profile.py").write_text("def run():\n    pass\n")
    objects = docstring_refs.index(tree)
    store = Scope("persia_planner.modules.ps.store")
    assert objects.resolve("profile.typo", store) is None
    assert objects.resolve(".profile.run", store) == "persia_planner.modules.ps.profile.run"
    assert objects.resolve("os.fork", store) == "os.fork"


def test_the_packages_do_not_name_a_benchmark(tree):
    objects = docstring_refs.index(tree)
    assert objects.resolve("target", Scope("fuzz")) == "fuzz.target"
    assert objects.resolve("fuzz.target", Scope("persia_planner.planner")) is None


@pytest.mark.parametrize(
    ("text", "target", "shown"),
    [
        (
            "~.hybrid.HybridEmbeddingBagCollection",
            ".hybrid.HybridEmbeddingBagCollection",
            "HybridEmbeddingBagCollection",
        ),
        (".config.TrainConfig", ".config.TrainConfig", "config.TrainConfig"),
        ("run_trainers()", "run_trainers", "run_trainers()"),
        ("the trainers <run_trainers>", "run_trainers", "the trainers"),
        ("!unchecked", "unchecked", "unchecked"),
    ],
)
def test_what_a_role_points_to_and_shows(text, target, shown):
    ref = docstring_refs.Reference(Path("x.py"), 1, "func", text, Scope("x"))
    assert (ref.target, ref.shown) == (target, shown)


def test_a_broken_reference_fails_check_docs(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "repository"
    skip = shutil.ignore_patterns(".venv", ".git", "site", ".hypothesis", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, copy, symlinks=True, ignore=skip)
    units = copy / "persia_planner" / "units.py"
    text = units.read_text()
    assert text.startswith('"""')
    units.write_text(text.replace('"""', '"""See :func:`.parse_sizes`. ', 1))
    monkeypatch.setattr(sys, "argv", ["check_docs.py", str(copy)])
    assert check_docs.main() == 1
    assert capsys.readouterr().out.splitlines() == [
        "persia_planner/units.py:1: :func:`.parse_sizes`: no such name (looked in module persia_planner.units)"
    ]
