"""Fuzzing: mutated shards, sidecars and manifests either read back correctly or raise a
StreamloadError — never another exception type, a hang or a crash.

CI runs a bounded number of cases per format; for a long run::

    STREAMLOAD_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz.py -q
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamload import StreamingDataset, StreamloadError
from streamload.writer import DatasetWriter

EXAMPLES = int(os.environ.get("STREAMLOAD_FUZZ_EXAMPLES", "120"))
FORMATS = ["tar", "lmdb", "hdf5"]


def _samples() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(12):
        sample: dict[str, object] = {
            "__key__": f"dir/k{i:03d}",
            "bin": bytes([i]) * (50 + 37 * i),
            "cls": str(i % 3).encode(),
        }
        if i % 4 == 0:
            sample["txt"] = "ünï".encode() * i
        out.append(sample)
    return out


@pytest.fixture(scope="module", params=FORMATS)
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    with DatasetWriter(str(root), format=request.param, max_samples=5) as writer:
        for sample in _samples():
            writer.write(sample)
    expected = [dict(s) for s in StreamingDataset(str(root))]
    return root, expected


mutation = st.tuples(
    st.sampled_from(["flip", "truncate", "insert", "overwrite", "zero"]),
    st.floats(min_value=0, max_value=1, allow_nan=False),
    st.binary(min_size=1, max_size=16),
)


def _mutate(data: bytes, kind: str, where: float, payload: bytes) -> bytes:
    pos = min(int(where * len(data)), max(len(data) - 1, 0))
    if kind == "flip" and data:
        return data[:pos] + bytes([data[pos] ^ (payload[0] or 1)]) + data[pos + 1 :]
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + payload + data[pos:]
    if kind == "overwrite":
        return data[:pos] + payload + data[pos + len(payload) :]
    return data[:pos] + bytes(len(payload)) + data[pos + len(payload) :]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.integers(min_value=0, max_value=10**6), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_dataset_reads_correctly_or_raises_streamload_error(
    pristine: tuple[Path, list[dict]], tmp_path_factory: pytest.TempPathFactory, target: int, mutations: list
) -> None:
    root, expected = pristine
    work = tmp_path_factory.mktemp("case")
    shutil.rmtree(work)
    shutil.copytree(root, work)
    files = sorted(p for p in work.iterdir() if p.is_file())
    victim = files[target % len(files)]
    data = victim.read_bytes()
    for kind, where, payload in mutations:
        data = _mutate(data, kind, where, payload)
    victim.write_bytes(data)
    try:
        got = [dict(s) for s in StreamingDataset(str(work))]
    except StreamloadError:
        return
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # No error: then every sample must be exactly right. (Bytes that are never read, such
    # as tar headers or class names, may change without effect.)
    assert got == expected, f"silent corruption after mutating {victim.name}"
