"""Modules that moved keep their old import paths (``moved_modules.MOVED``), and the package's public names are
found where ``persia_planner.modules`` says they live."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

import persia_planner.modules as public
from persia_planner.modules import moved_modules

MODULES = Path(public.__file__).resolve().parent


def _file_of(dotted: str) -> Path:
    rest = dotted.removeprefix("persia_planner.modules.").split(".")
    return MODULES.joinpath(*rest).with_suffix(".py")


@pytest.mark.parametrize(("old", "new"), sorted(moved_modules.MOVED.items()))
def test_every_moved_path_names_a_module_that_exists_and_no_file_is_left_at_the_old_one(old, new):
    assert _file_of(new).is_file() or (_file_of(new).with_suffix("") / "__init__.py").is_file()
    assert not _file_of(old).exists() and not _file_of(old).with_suffix("").is_dir()


def test_an_old_path_imports_the_moved_module_itself_and_warns_with_its_new_home():
    sys.modules.pop("persia_planner.modules.rpcenv", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("persia_planner.modules.rpcenv")
        from persia_planner.modules.rpcenv import rpc_transports
    new = importlib.import_module("persia_planner.modules.rpc_environment")
    assert old is new and rpc_transports is new.rpc_transports
    assert new.__spec__.name == "persia_planner.modules.rpc_environment"  # its own spec, not the alias's
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert messages == [
        "persia_planner.modules.rpcenv moved to persia_planner.modules.rpc_environment; import it from there"
    ]


def test_the_finder_answers_for_old_paths_only():
    finder = moved_modules.MovedModuleFinder()
    assert finder.find_spec("persia_planner.modules.rpc_environment", None) is None
    assert finder.find_spec("persia_planner.modules.no_such_module", None) is None
    assert finder.find_spec("persia_planner.modules.hybrid", None).name == "persia_planner.modules.hybrid"
    assert importlib.util.find_spec("persia_planner.modules.nothing_here") is None


def _homes() -> dict[str, str]:
    """The package's map of each public name to its module, as its ``__init__`` writes it."""
    tree = ast.parse((MODULES / "__init__.py").read_text(encoding="utf-8"))
    (homes,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)]
    return ast.literal_eval(homes)


def test_every_public_name_is_defined_in_its_home_module():
    homes = _homes()
    assert sorted(public.__all__) == sorted(homes) and len(homes) > 10
    for name, home in homes.items():
        tree = ast.parse(_file_of(home).read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        assert name in defined, f"{home} defines no {name}"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        public.Nope  # noqa: B018
