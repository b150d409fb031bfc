#!/usr/bin/env bash
# Install the peer libraries the benchmark compares against, WITHOUT touching the main
# venv: MosaicML Streaming and LitData pull torchvision (and a CUDA torch) through their
# requirements, and boto3 would move the botocore that s3fs/aiobotocore pin. So they go
# into their own venv under benchmarks/out/, which sees the main venv's packages
# (torch 2.13.0 CPU, numpy, streamload itself) through a .pth file, and gets only the
# imports the peers need at run time, installed with --no-deps.
#
#   bash benchmarks/setup_peers.sh          # then: benchmarks/out/peers-venv/bin/python benchmarks/run.py
#                                           #   or: python benchmarks/bench_remote.py (runs the peers with it)
# It never installs torch (every install is --no-deps); re-running it is safe.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main_venv="${STREAMLOAD_VENV:-$here/.venv}"
peers="$here/benchmarks/out/peers-venv"
mkdir -p "$here/benchmarks/out"
if [ ! -x "$peers/bin/python" ]; then
    "$main_venv/bin/python" -m venv "$peers"
fi
site_main="$("$main_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
site_peers="$("$peers/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path) so the main venv's own .pth files -- the editable
# streamload install among them -- are processed too.
echo "import site; site.addsitedir('$site_main')" > "$site_peers/_streamload_main_venv.pth"
pip=("$peers/bin/python" -m pip install -q --no-deps)
# The peers themselves (no torchvision, no torch from their requirements).
"${pip[@]}" mosaicml-streaming litdata
# What they import at run time (pure-python or small wheels); torch/numpy come from the main venv.
# boto3 must match the main venv's botocore (the one s3fs/aiobotocore pin, seen through the .pth
# file): boto3 X.Y.Z requires botocore >= X.Y.Z of the same minor, so take the same version.
botocore_version="$("$main_venv/bin/python" -c 'import botocore; print(botocore.__version__)')"
"${pip[@]}" "boto3==$botocore_version" || "${pip[@]}" "boto3<=$botocore_version"
"${pip[@]}" s3transfer jmespath python-dateutil six urllib3 \
    lightning-utilities filelock requests idna certifi charset-normalizer \
    tifffile obstore Brotli python-snappy zstd catalogue packaging typing-extensions \
    tqdm xxhash || true
# MosaicML Streaming needs transformers (its StreamingDataLoader isinstance-checks two
# classes) and cramjam; transformers pins huggingface_hub<1 and tokenizers<=0.23.0.
"${pip[@]}" "transformers<5" "huggingface_hub<1.0" "tokenizers>=0.22,<=0.23.0" safetensors regex \
    pyyaml cramjam || true
# streaming.vision imports torchvision at module level (VisionDataset, to_tensor) though
# nothing the benchmark uses touches it. A real torchvision wheel needs its own torch
# build, so the peers venv gets a two-name stand-in instead; it is never called.
stub="$site_peers/torchvision"
if [ ! -e "$stub/_streamload_stub" ]; then
    mkdir -p "$stub/datasets" "$stub/transforms"
    touch "$stub/_streamload_stub"
    printf '"""Stand-in for torchvision in the peers venv (see benchmarks/setup_peers.sh)."""\n' > "$stub/__init__.py"
    printf 'class VisionDataset:\n    """Unused stand-in."""\n' > "$stub/datasets/__init__.py"
    printf '' > "$stub/transforms/__init__.py"
    printf 'def to_tensor(pic):\n    raise NotImplementedError("torchvision stand-in")\n' > "$stub/transforms/functional.py"
fi
"$peers/bin/python" - <<'PY'
for name in ("webdataset", "streaming", "litdata"):
    try:
        __import__(name)
        print(f"peer {name}: ok")
    except Exception as exc:  # report, do not fail: the benchmark skips what is missing
        print(f"peer {name}: unavailable ({type(exc).__name__}: {exc})")
PY
