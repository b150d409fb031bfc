"""The process around the datasets: a clean interpreter exit, and many live datasets under a low fd limit."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.indexing import index_directory
from streamload.synthetic import make_image_folder

FORMATS = ("tar", "lmdb", "hdf5", "parquet")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small dataset (8 samples, 2 shards where the format has shards) per format."""
    root = tmp_path_factory.mktemp("formats")
    images = root / "images"
    make_image_folder(str(images), num_classes=2, per_class=4, size=(16, 16), seed=3)
    out = {}
    for fmt in ("tar", "lmdb", "hdf5"):
        out[fmt] = root / fmt
        convert(
            ImageFolderSource(str(images)),
            str(out[fmt]),
            ConvertOptions(format=fmt, samples_per_shard=4, progress=False),
        )
    pq_dir = root / "parquet"
    pq_dir.mkdir()
    rows = []
    for i in range(8):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(buf, "PNG")
        rows.append({"bytes": buf.getvalue(), "path": None})
    pq.write_table(
        pa.table({"image": rows, "label": [i % 2 for i in range(8)]}), str(pq_dir / "a.parquet"), row_group_size=4
    )
    index_directory(str(pq_dir), format="parquet")
    out["parquet"] = pq_dir
    return out


def run_python(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_nothing_is_printed_at_exit_with_iterators_and_datasets_alive(datasets: dict[str, Path]) -> None:
    """Every format: half-read iterators (also in reference cycles), a reader's generator and
    open ShardedDatasets left alive at exit (one interpreter for the four formats: each
    start costs seconds)."""
    code = f"""
        import streamload as s
        urls = {[str(datasets[f]) for f in FORMATS]!r}
        keep = []
        for url in urls:
            ds = s.StreamingDataset(url)
            it = iter(ds)
            next(it)
            shuffled = s.StreamingDataset(url, shuffle=True, seed=1)
            it2 = iter(shuffled)
            next(it2)
            shuffled.cycle = (shuffled, it2)
            sd = s.ShardedDataset(url)
            sd[0]
            sd.get(sd.key_of(5))
            looped = s.ShardedDataset(url)
            looped[7]
            looped.cycle = looped
            members = sd._source().get(0).iter_range(0, 3)
            next(members)
            keep.append((ds, it, sd, members))
            print(sd.manifest.format)
    """
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == list(FORMATS)
    assert done.stderr == ""


def test_hundreds_of_live_datasets_fit_a_low_descriptor_limit(datasets: dict[str, Path]) -> None:
    """600 StreamingDatasets alive under a soft limit of 256 descriptors, some iterated (also by
    persistent workers that set_epoch reaches); with no descriptor left, a clear error."""
    code = f"""
        import os, resource
        from torch.utils.data import DataLoader
        import streamload as s

        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        url = {str(datasets["tar"])!r}
        many = [s.StreamingDataset(url, shuffle=True, seed=i) for i in range(600)]
        for ds in many[::150]:
            assert len(list(ds)) == 8
        taken = []
        try:
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            s.StreamingDataset(url)
        except s.StreamloadError as exc:
            print(type(exc).__name__, exc)
        from streamload._shared import ARENA_WORDS, shared_block
        try:
            shared_block(ARENA_WORDS)  # a new segment: what the next dataset's counters would need
        except s.StreamloadError as exc:
            print(type(exc).__name__, exc)
        for fd in taken:
            os.close(fd)
        ds = many[-1]
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        keys = [sorted(sample["__key__"] for sample in loader) for _ in range(2)]
        assert keys[0] == keys[1] and len(keys[0]) == 8
        ds.set_epoch(7)
        assert sum(1 for _ in loader) == 8 and ds.epoch == 7, ds.epoch
        print(len(many), "datasets")
    """
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[2] == "600 datasets"
    assert lines[0].startswith("StorageError cannot read ") and "Too many open files" in lines[0]
    assert lines[1].startswith("StreamloadError cannot make shared memory for a dataset's counters: the process has ")
    assert "file descriptors open, its limit (ulimit -n) is 256" in lines[1]


def test_a_worker_error_frees_the_dataloader_iterator_at_once(tmp_path: Path) -> None:
    """A streamload error from a DataLoader worker leaves no reference cycle holding the iterator.

    Re-raised in the main process from a local variable, the error and its frame would hold
    each other, keeping the iterator for the garbage collector, which closes its queues
    before the iterator's shutdown asks the workers to stop: 5 s of waiting per worker.
    """
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from streamload import CorruptShardError, DatasetWriter, StreamingDataset

    root = tmp_path / "ds"
    with DatasetWriter(str(root), max_samples=20) as writer:
        for i in range(80):
            writer.write({"__key__": f"k{i:03d}", "bin": bytes([i]) * 4000})
    shard = root / "shard-000001.tar"
    raw = bytearray(shard.read_bytes())
    at = raw.index(bytes([25]) * 4000)
    raw[at + 100 : at + 110] = bytes(10)
    shard.write_bytes(bytes(raw))

    loader = DataLoader(StreamingDataset(str(root)), batch_size=None, num_workers=2)
    gc.disable()  # whatever stays alive here is held by a cycle
    try:
        iterator = iter(loader)
        alive = weakref.ref(iterator)
        with pytest.raises(CorruptShardError, match=r"shard-000001\.tar"):
            for _ in iterator:
                pass
        del iterator
        assert alive() is None, "the error's traceback keeps the iterator in a reference cycle"
    finally:
        gc.enable()
