#!/usr/bin/env bash
# Set up .venv, check lint, formatting and types, and run the whole test suite (what CI runs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
# shellcheck disable=SC1091
source scripts/setup.sh test
checked=(streamload tests benchmarks docs scripts README.md)
echo "== ruff check"
ruff check "${checked[@]}"
echo "== ruff format --check"
ruff format --check "${checked[@]}"
echo "== mypy --strict (streamload)"
mypy --strict streamload
echo "== pytest (2 processes; a test file stays in one of them)"
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
