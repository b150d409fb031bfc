"""Real DDP jobs: torchrun launchers (gloo on loopback) running a worker script over a JSON config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

DDP_WORKER = str(Path(__file__).resolve().parent.parent / "ddp_worker.py")
LAUNCH_TIMEOUT = 200


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    config: Path, nproc: int, port: int, nnodes: int = 1, node_rank: int = 0, worker: str = DDP_WORKER
) -> subprocess.Popen[bytes]:
    """Start one torchrun launcher (one node) of ``nproc`` ranks running ``worker config``."""
    # PYTHONFAULTHANDLER: a rank that dies of a signal (a native abort) prints every thread's Python stack.
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONFAULTHANDLER="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if nnodes == 1:  # the launcher binds a free port itself: no race for the port
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *where, worker, str(config)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_job(
    tmp: Path,
    name: str,
    data: Path,
    tasks: list[dict[str, Any]],
    nproc: int,
    nnodes: int = 1,
    worker: str = DDP_WORKER,
    **extra: Any,
) -> Any:
    """Run ``tasks`` on ``nnodes`` x ``nproc`` ranks; every rank's results, by rank then task."""
    config, out = tmp / f"{name}.json", tmp / f"{name}-out.json"
    config.write_text(json.dumps({"data": str(data), "out": str(out), "tasks": tasks, **extra}))
    port = free_port()
    procs = [torchrun(config, nproc, port, nnodes, node, worker) for node in range(nnodes)]
    logs = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
            logs.append(_log_tail(stdout.decode(errors="replace")))
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    result = json.loads(out.read_text())
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(nproc * nnodes))
    return [r["results"] for r in ranks]  # [rank][task]


def _log_tail(text: str, keep: int = 12000) -> str:
    """The end of a launcher's output, without the lines a warning repeats per worker (they hid the cause)."""
    seen: set[str] = set()
    lines = []
    for line in text.splitlines():
        if "Warning" in line or line.strip().startswith("data = fetcher.fetch"):
            if line in seen:
                continue
            seen.add(line)
        lines.append(line)
    return "\n".join(lines)[-keep:]
