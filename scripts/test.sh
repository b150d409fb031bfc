#!/usr/bin/env bash
# Set up .venv and run the whole test suite (what CI runs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
# shellcheck disable=SC1091
source scripts/setup.sh test
python -m pytest -q -p no:cacheprovider "$@"
