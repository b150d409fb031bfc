"""A real DDP job (torchrun, 2 ranks, gloo) mixing a local tar dataset with an LMDB dataset in an S3 bucket.

One launch (process start and torch imports cost seconds); the job is tests/ddp_mix_worker.py.
Checked here: equal batches on both ranks (else the all-reduce would hang), exact
per-stream counts per epoch (plus the padding), a different subset each epoch, and the
plain-loop resume continuing exactly where the stopped run left off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.datasets import write_dataset
from tests.s3server import SeaweedS3

WORKER = str(Path(__file__).with_name("ddp_mix_worker.py"))
TAR, LMDB = [12, 9, 0, 14], [10, 11]  # 35 and 21 samples
EPOCH, BATCH, STOP = 50, 5, 3  # tar 30 of 35, lmdb 20 of 21; 25 per rank = 5 batches
LAUNCH_TIMEOUT = 200

pytestmark = [pytest.mark.slow, pytest.mark.timeout(LAUNCH_TIMEOUT + 100)]


def test_ddp_mixture_of_local_tar_and_lmdb_in_a_bucket(s3_server: SeaweedS3, tmp_path: Path) -> None:
    options = s3_server.storage_options()
    tar = write_dataset(str(tmp_path / "tar"), "tar", TAR, "t")
    lmdb = write_dataset(f"s3://{s3_server.make_bucket()}/lmdb", "lmdb", LMDB, "l", options)
    out = tmp_path / "out.json"
    config = {
        "tar": tar,
        "lmdb": lmdb,
        "storage_options": options,
        "cache": str(tmp_path / "cache"),
        "out": str(out),
        "epoch_size": EPOCH,
        "batch": BATCH,
        "stop": STOP,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", WORKER]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "config.json")], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = sorted(json.loads(out.read_text()), key=lambda r: r["rank"])

    assert [r["len"] for r in ranks] == [EPOCH // 2] * 2
    subsets = []
    for epoch in range(2):
        per_rank = [[k for b in r["epochs"][epoch] for k in b] for r in ranks]
        assert [len(keys) for keys in per_rank] == [EPOCH // 2] * 2
        union = Counter(k for keys in per_rank for k in keys)
        assert Counter(k.split(":")[0] for k in union.elements()) == {"tar": 30, "lmdb": 20}
        assert max(union.values()) == 1, "subsampled streams: every sample at most once"
        assert {k.split(":")[1][0] for k in union if k.startswith("lmdb:")} == {"l"}
        subsets.append(set(union))
    assert subsets[0] != subsets[1], "another subset each epoch"
    for r in ranks:
        full = [k for b in r["epochs"][0] for k in b]
        seen = [k for b in r["seen"] for k in b]
        rest = [k for b in r["rest"] for k in b]
        assert len(seen) == STOP * BATCH
        assert seen + rest == full, "the resumed run continues each rank's order exactly"
