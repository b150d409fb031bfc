#!/usr/bin/env bash
# Set up .venv and run `streamload demo`: synthetic images -> shards -> DataLoader.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
# shellcheck disable=SC1091
source scripts/setup.sh test
streamload demo "$@"
