#!/usr/bin/env bash
# The project's test command (README and CI run exactly this): lint, unit/property/CLI tests, the tutorials.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# pytest exits 5 when it collects no test: with `set -e` that fails the run, as it must.
"$PY" -m pytest tests tutorials --nbmake -p no:cacheprovider "$@"
