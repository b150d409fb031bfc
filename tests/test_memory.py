"""A worker's peak RSS does not grow with the dataset's size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from streamload import DatasetWriter

_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    from streamload import StreamingDataset

    class Probe(IterableDataset):
        def __init__(self, inner):
            self.inner = inner
        def __iter__(self):
            n = 0
            for sample in self.inner:
                n += len(sample["bin"])
            yield {"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "bytes": n,
                   "worker": get_worker_info().id}

    ds = StreamingDataset(sys.argv[1])
    out = list(DataLoader(Probe(ds), batch_size=None, num_workers=2))
    print(json.dumps([{k: int(v) for k, v in o.items()} for o in out]))
    """
)


def _write(root: Path, n: int) -> None:
    with DatasetWriter(str(root), max_samples=1000, hash_algorithm=None) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:07d}", "bin": bytes([i % 251]) * (2000 + i % 500), "cls": b"1"})


def _worker_peak_kb(root: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root)], check=True, capture_output=True, text=True)
    results = json.loads(out.stdout)
    assert len(results) == 2
    return max(r["rss_kb"] for r in results), sum(r["bytes"] for r in results)


def test_worker_rss_does_not_grow_with_dataset_size(tmp_path: Path) -> None:
    _write(tmp_path / "small", 2_000)
    _write(tmp_path / "large", 20_000)
    small_kb, small_bytes = _worker_peak_kb(tmp_path / "small")
    large_kb, large_bytes = _worker_peak_kb(tmp_path / "large")
    assert large_bytes > 9 * small_bytes  # the large run really read 10x the data (~45 MB)
    # 10x the samples and bytes; a worker holding the data would grow by >40 MB.
    print(small_kb, large_kb)
    assert large_kb - small_kb < 8 * 1024, (small_kb, large_kb)
