#!/usr/bin/env bash
# The project's test command (README and CI run exactly this): lint, the docs build, unit/property/CLI tests, the
# tutorials.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# Which module may import which (pyproject.toml's [tool.importlinter] contracts). import-linter reads the packages from
# disk and cannot follow the package-dir mapping of persia_planner.modules (modules/), so it reads a copy of the two
# laid out as installed.
root=$PWD tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
cp -R persia_planner "$tree/" && rm -rf "$tree/persia_planner/modules" && cp -R modules "$tree/persia_planner/modules"
(cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/lint-imports" "$root/pyproject.toml" --no-cache --no-logo)
# The API reference site (mkdocs.yml); --strict fails on any warning (a docstring griffe cannot parse, a broken anchor).
PERSIA_DOCS_SRC="$tree" "$PY" -m mkdocs build --strict --quiet
# pytest exits 5 when it collects no test: with `set -e` that fails the run, as it must.
"$PY" -m pytest tests tutorials --nbmake -p no:cacheprovider "$@"
