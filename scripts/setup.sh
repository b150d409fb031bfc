#!/usr/bin/env bash
# Create .venv (Python 3.10+) with torch 2.13.0 (CPU wheel) and streamload installed editable.
# Usage: source scripts/setup.sh [extras]   (extras default: test)
set -euo pipefail
extras="${1:-test}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# The stamp covers what the install builds: a changed pyproject, setup.py or native kernel
# source (streamload/*.c, *.h, streamload/decode/*.c) reinstalls, which rebuilds the kernel in place.
stamp=".venv/.streamload-$(cat pyproject.toml setup.py streamload/*.c streamload/*.h streamload/decode/*.c | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages.
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
  # setuptools' "Editable installation ... folders with the same name as your package" notice is
  # printed for every editable install (information, nothing to act on); filtered by its text so
  # that `bash scripts/demo.sh` opens with the demo.
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[$extras]" 2>&1 \
    | grep -v "is ignored" || true
  python -c "import torch, streamload; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  touch "$stamp"
fi
