"""scripts/check_docs.py: every module, function and file the documents name exists, and a stale name is caught."""

from pathlib import Path

from benchmark_modules import load

ROOT = Path(__file__).resolve().parents[1]
check_docs = load("check_docs", ROOT / "scripts")


def test_the_documents_name_only_what_exists():
    assert check_docs.problems(ROOT) == []


def test_a_stale_module_function_member_or_path_is_named(tmp_path):
    (tmp_path / "persia_planner").mkdir()
    (tmp_path / "persia_planner" / "__init__.py").write_text("")
    units = ["class Quantity:", "    SIZE = 1", "", "    def parse(self):", "        self.seen = True", ""]
    units += ["", "def format_bytes(n):", "    pass", ""]
    (tmp_path / "persia_planner" / "units.py").write_text("\n".join(units))
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "Fine: `persia_planner.units.format_bytes`, `persia_planner.units.Quantity.parse`, `units.format_bytes`, "
        "`Quantity.seen`, `units.Quantity.parse`, `torch.optim`, `plan.json`, 127.0.0.1, docs/page.md.\n"
        "Stale: `persia_planner.units.parse_size`, `persia_planner.cost`, `persia_planner.units.Quantity.RATE`, "
        "`units.parse_size`, `Quantity.rate`, `units.Quantity.RATE`, `plan_checks.validate`, modules/train.py:407, "
        "`search/devices.py`.\n"
    )
    for name in ("README.md", "CONTRIBUTING.md"):
        (tmp_path / name).write_text("")
    assert check_docs.problems(tmp_path) == [
        "docs/page.md: persia_planner.cost: persia_planner defines no 'cost'",
        "docs/page.md: persia_planner.units.Quantity.RATE: class Quantity has no 'RATE'",
        "docs/page.md: persia_planner.units.parse_size: persia_planner.units defines no 'parse_size'",
        "docs/page.md: units.parse_size: no module named 'units' defines 'parse_size'",
        "docs/page.md: Quantity.rate: class Quantity has no 'rate'",
        "docs/page.md: units.Quantity.RATE: class Quantity has no 'RATE'",
        "docs/page.md: plan_checks.validate: no module named 'plan_checks' (or add it to check_docs's other libraries)",
        "docs/page.md: search/devices.py: no such file in persia_planner/ or modules/",
        "docs/page.md: modules/train.py: no such file or directory",
    ]
