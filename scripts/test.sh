#!/usr/bin/env bash
# The project's test command (README and CI run exactly this): lint, the import contracts, the docs build and the
# names the docs use, every test and the tutorials.
#   scripts/test.sh --fast [PYTEST ARGS]   the fast tier: the same checks and the tests that start no process
#                                          (unit, property and in-process CLI tests), in a few minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
fi
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# Which module may import which (pyproject.toml's [tool.importlinter] contracts).
.venv/bin/lint-imports --no-cache --no-logo
# The API reference site (mkdocs.yml); --strict fails on any warning (a docstring griffe cannot parse, a broken anchor).
"$PY" -m mkdocs build --strict
# Every module, function and path the documents name exists; every link and anchor leads somewhere; the layout page
# lists every source file; the tutorials name only what exists.
"$PY" scripts/check_docs.py
# pytest exits 5 when it collects no test: with `set -e` that fails the run, as it must.
# Two pytest-xdist workers: on CI's 2 cores the suite takes about 0.65 of its serial time (tests that start processes
# spend much of theirs waiting on them). PYTEST_WORKERS=0 runs it serially, in one process.
workers=(-n "${PYTEST_WORKERS:-2}")
if ((fast)); then
  "$PY" -m pytest tests -m "not processes" -p no:cacheprovider "${workers[@]}" "$@"
else
  "$PY" -m pytest tests tutorials --nbmake -p no:cacheprovider "${workers[@]}" "$@"
fi
