"""What :func:`streamload.watch` found: the :class:`DataReport` and its verdict.

The verdict is one sentence for a person, drawn from the report's figures only: whether
the loop is input-bound, which stage takes the readers' time, and the knob to turn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ._errors import ConfigError
from .timing import STAGES

__all__ = ["DataReport", "percent", "verdict"]

#: Below this wait fraction the loop is not input-bound; at or above ``_BOUND`` it is.
_CALM, _BOUND = 0.05, 0.20
#: Readers busy less than this share of the time while the loop waits: the stages are not the bottleneck.
_IDLE_READERS = 0.5


@dataclass
class DataReport:
    """What a watched loop waited for, and where the readers' time went.

    Attributes:
        steps: Batches the loop received.
        first_batch_s: Seconds until the first batch (start-up: workers, shard opens),
            ``None`` in a report over a later window.
        wall_s: The loop's wall time after the first batch (iterations only: time
            between epochs is left out).
        wait_s: Of ``wall_s``, the seconds spent waiting for the next batch.
        wait_fraction: ``wait_s / wall_s``: the share of the loop spent waiting on data.
        wait_p50_ms: Median wait per step (ms), the first batch left out.
        wait_p95_ms: 95th percentile of the wait per step (ms).
        wait_p99_ms: 99th percentile of the wait per step (ms).
        stages: Seconds per stage summed over all readers (workers or threads):
            ``"fetch"`` (bytes from storage, cache waits included), ``"read"`` (shards
            parsed into samples), ``"transform"`` (the per-sample transform), ``"collate"``
            (the dataset's collate, e.g. ``DecodeBatch``, and the DataLoader's).
        readers: Worker processes or threads whose stage times arrived (0: none measured).
        busy_fraction: Share of the readers' time after the first batch spent in the stages
            (``None``: unknown); low while the loop waits: the batches are slow to reach it.
        settings: The loader's settings the verdict draws on (workers, prefetch, storage...).
        verdict: One sentence: input-bound or not, the stage to blame, the knob to turn.
        rank: This process's rank (0 without ``torch.distributed``).
        ranks: With ``all_ranks=True``: every rank's report, in rank order.
        slowest_rank: With ``all_ranks=True``: the rank that waited longest on data.
        waits_ms: The wait of every step after the first (ms), for :meth:`plot`.
        device_stages: Seconds of the stages run in the training process on its device,
            apart from the readers' (a :class:`~streamload.DeviceDecode`'s ``"decode"``,
            timed with CUDA events on a GPU); empty when there are none.
        gil_wait_p50_ms: With a loader whose readers are threads: the median time a thread
            took to get the GIL back after letting go of it (a probe, 20 times a second);
            near the switch interval (5 ms) when some thread runs Python without pause.
            ``None``: not probed (worker processes, or too few probes).
        gil_busy: The share of those probes that waited at least half a switch interval:
            how much of the time the loop and the loader's threads contend for the GIL.
        loop_cpu_share: With the probe: the CPU time of the thread that watched the loader
            (the loop's) over the wall time: near 1 when the loop ran Python all along,
            lower when it waited (for the GIL, the device or data).
    """

    steps: int
    first_batch_s: float | None
    wall_s: float
    wait_s: float
    wait_fraction: float
    wait_p50_ms: float
    wait_p95_ms: float
    wait_p99_ms: float
    stages: dict[str, float]
    readers: int
    busy_fraction: float | None
    settings: dict[str, Any] = field(default_factory=dict)
    verdict: str = ""
    rank: int = 0
    ranks: list[DataReport] | None = None
    slowest_rank: int | None = None
    waits_ms: list[float] = field(default_factory=list, repr=False)
    device_stages: dict[str, float] = field(default_factory=dict)
    gil_wait_p50_ms: float | None = None
    gil_busy: float | None = None
    loop_cpu_share: float | None = None

    @property
    def stage_shares(self) -> dict[str, float]:
        """Each stage's share of the readers' stage time (0 to 1; all 0 when none was measured)."""
        total = sum(self.stages.values())
        return {name: (self.stages.get(name, 0.0) / total if total > 0 else 0.0) for name in STAGES}

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        """The figures a logger takes: wait fraction, p50/p95 wait (ms), first batch, and each stage's share."""
        out = {
            f"{prefix}wait_fraction": self.wait_fraction,
            f"{prefix}wait_p50_ms": self.wait_p50_ms,
            f"{prefix}wait_p95_ms": self.wait_p95_ms,
        }
        if self.first_batch_s is not None:
            out[f"{prefix}first_batch_s"] = self.first_batch_s
        if self.readers:
            out.update({f"{prefix}share_{name}": share for name, share in self.stage_shares.items()})
        out.update({f"{prefix}device_{name}_s": seconds for name, seconds in self.device_stages.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (JSON-safe), without the per-step waits."""
        out = asdict(self)
        out.pop("waits_ms")
        out["ranks"] = None if self.ranks is None else [r.to_dict() for r in self.ranks]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataReport:
        """Rebuild a report from :meth:`to_dict`."""
        values = dict(data)
        ranks = values.pop("ranks", None)
        report = cls(**values)
        report.ranks = None if ranks is None else [cls.from_dict(r) for r in ranks]
        return report

    def __str__(self) -> str:
        first = "-" if self.first_batch_s is None else f"{self.first_batch_s:.2f} s"
        lines = [
            f"DataReport: {self.steps} steps, first batch after {first}",
            f"waiting for data  {percent(self.wait_fraction)} of {self.wall_s:.2f} s after the first batch "
            f"(per step: p50 {self.wait_p50_ms:.1f} ms, p95 {self.wait_p95_ms:.1f} ms, p99 {self.wait_p99_ms:.1f} ms)",
            f"{'stage':<10} {'seconds':>9} {'share':>7}",
        ]
        shares = self.stage_shares
        for name in STAGES:
            lines.append(f"{name:<10} {self.stages.get(name, 0.0):>9.2f} {percent(shares[name]):>7}")
        if self.readers:
            busy = "" if self.busy_fraction is None else f", busy {percent(self.busy_fraction)} of the time"
            lines.append(f"readers: {_readers(self)}{busy}")
        else:
            lines.append("readers: stage times not measured")
        for name, seconds in self.device_stages.items():
            lines.append(f"on the device: {name} {seconds:.2f} s")
        if self.gil_busy is not None:
            lines.append(
                f"GIL: taking it back took {self.gil_wait_p50_ms:.2f} ms (median); "
                f"{percent(self.gil_busy)} of the probes waited half a switch interval or more"
            )
        if self.ranks:
            lines.append(f"{'rank':>4} {'steps':>6} {'waiting':>8} {'p95 ms':>8}  top stage")
            for r in self.ranks:
                top = _top_stage(r)
                mark = "  <- slowest" if r.rank == self.slowest_rank else ""
                lines.append(
                    f"{r.rank:>4} {r.steps:>6} {percent(r.wait_fraction):>8} {r.wait_p95_ms:>8.1f}  {top or '-'}{mark}"
                )
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Draw the waits per step and the stage breakdown (and each rank's wait); return the figure.

        Needs matplotlib (``pip install streamload[plot]``), imported only here.

        Args:
            path: Also save the figure there (e.g. ``"report.png"``).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ConfigError("DataReport.plot() needs matplotlib: pip install streamload[plot]") from exc
        panels = 3 if self.ranks else 2
        fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
        ax = axes[0]
        ax.plot(range(2, len(self.waits_ms) + 2), self.waits_ms, lw=0.8, color="tab:red")
        ax.axhline(self.wait_p95_ms, ls="--", lw=0.8, color="grey", label=f"p95 {self.wait_p95_ms:.1f} ms")
        ax.set_xlabel("step")
        ax.set_ylabel("wait for the batch (ms)")
        ax.set_title(f"waiting {percent(self.wait_fraction)} of the loop")
        ax.legend(fontsize="small")
        ax = axes[1]
        shares = self.stage_shares
        names = list(STAGES)[::-1]
        ax.barh(names, [self.stages.get(n, 0.0) for n in names], color="tab:blue")
        for i, name in enumerate(names):
            ax.text(self.stages.get(name, 0.0), i, f" {percent(shares[name])}", va="center", fontsize="small")
        ax.set_xlabel("seconds, all readers")
        ax.set_title("where the readers' time goes")
        if self.ranks:
            ax = axes[2]
            colors = ["tab:red" if r.rank == self.slowest_rank else "tab:grey" for r in self.ranks]
            ax.bar([str(r.rank) for r in self.ranks], [100 * r.wait_fraction for r in self.ranks], color=colors)
            ax.set_xlabel("rank")
            ax.set_ylabel("waiting (% of the loop)")
            ax.set_title("per rank")
        fig.tight_layout()
        if path is not None:
            fig.savefig(os.fspath(path), dpi=110)
        return fig


def percent(x: float) -> str:
    """``x`` (a share) in percent, for a person: one decimal, none near 100 %."""
    return f"{100 * x:.1f} %" if x < 0.995 or x == 1 else f"{100 * x:.0f} %"


def _readers(r: DataReport) -> str:
    workers = r.settings.get("num_workers")
    if isinstance(workers, int):
        return f"{workers} DataLoader worker{'s' if workers != 1 else ''}" if workers else "the main process"
    return f"{r.readers} thread{'s' if r.readers != 1 else ''}"


def _top_stage(r: DataReport) -> str | None:
    shares = r.stage_shares
    top = max(STAGES, key=lambda n: shares[n])
    return top if shares[top] > 0 else None


def _more_workers(s: Mapping[str, Any]) -> str:
    workers, cpus = s.get("num_workers"), int(s.get("cpus") or 1)
    if workers is None:
        return "add reading threads"
    if workers >= cpus:
        return f"cut the CPU time per sample (num_workers={workers} already uses the {cpus} CPUs)"
    return f"raise num_workers ({workers} now, {cpus} CPUs)"


def _knob(stage: str, s: Mapping[str, Any]) -> str:
    """The knob to turn when ``stage`` takes the readers' time, as an imperative phrase."""
    more = _more_workers(s)
    if stage == "fetch":
        if s.get("remote"):
            if s.get("cache") == "none":
                return "fetch further ahead with a larger StorageConfig(stream_buffer=...)"
            ahead = s.get("read_ahead") or 8
            return (
                f"raise the read-ahead (StorageConfig(read_ahead=...), {ahead} shards now), or stream byte "
                'ranges with cache="none" when the cache is cold or too small'
            )
        return f"{more}, or put the shards on a faster disk"
    if stage == "read":
        if s.get("collate") is None:
            return f"read whole batches in the workers (collate=RawCollate(), zero copy), or {more}"
        return more
    if stage == "transform":
        return f"{more}, or decode whole batches with the fast decoder (collate=DecodeBatch(...), simplejpeg installed)"
    if s.get("collate") == "DecodeBatch":
        return f"{more}, or use the fast decoder (pip install simplejpeg; DecodeBatch(backend='simplejpeg'))"
    return f"make the batches in the dataset (collate=RawCollate() or DecodeBatch(...)), or {more}"


_WHAT = {
    "fetch": "fetching shards",
    "read": "reading samples",
    "transform": "the per-sample transform",
    "collate": "collating batches",
}


def verdict(r: DataReport) -> str:
    """One sentence for a person, from the report's figures: input-bound or not, the stage, the knob."""
    if r.steps < 2 or r.wall_s <= 0:
        return "Too few steps to judge: read more batches before asking for a report."
    gil = _gil_verdict(r)
    if gil is not None:
        return gil
    s = r.settings
    wf = r.wait_fraction
    workers = s.get("num_workers")
    top = _top_stage(r)
    shares = r.stage_shares
    if wf < _CALM:
        head = f"Not input-bound: the loop waits {percent(wf)} of its time for data (p95 {r.wait_p95_ms:.1f} ms)"
        tail = ", so the step itself sets the pace: speed up the model or the device, not the loader"
        if isinstance(workers, int) and workers > 1 and r.busy_fraction is not None and r.busy_fraction < 0.5:
            tail += f" (the {workers} workers are busy {percent(r.busy_fraction)} of the time: fewer would do)"
        return head + tail + "."
    kind = "Input-bound" if wf >= _BOUND else "Partly input-bound"
    head = f"{kind}: the loop waits {percent(wf)} of its time for data (p95 {r.wait_p95_ms:.1f} ms)"
    if top is None:
        return (
            f"{head}; stage times were not measured (watch the loader before its workers start), "
            "so try more workers or a larger prefetch_factor."
        )
    blame = f"{_WHAT[top]} takes {percent(shares[top])} of the readers' time"
    if workers == 0:
        cpus = int(s.get("cpus") or 1)
        return (
            f"{head}, and {blame}, all in the main process between steps: set DataLoader(num_workers=...) "
            f"(up to the {cpus} CPUs) so loading overlaps the step."
        )
    if r.busy_fraction is not None and r.busy_fraction < _IDLE_READERS:
        pf = s.get("prefetch_factor")
        return (
            f"{head}, yet the readers are busy only {percent(r.busy_fraction)} of the time: the batches are slow to "
            "reach the loop, so make whole batches in the workers (collate=RawCollate() or DecodeBatch(...)) "
            f"or raise prefetch_factor{'' if pf is None else f' ({pf} now)'}."
        )
    return f"{head}, and {blame}: {_knob(top, s)}."


#: Share of GIL probes that waited half a switch interval or more above which the verdict is the GIL's.
_GIL_BUSY = 0.25
#: The loop thread's CPU share above which it ran (rather than waited) all along.
_LOOP_RUNS = 0.9


def _gil_verdict(r: DataReport) -> str | None:
    """The verdict when the loop and the loader's threads contend for the GIL (``None``: they do not)."""
    if r.gil_busy is None or r.gil_busy < _GIL_BUSY:
        return None
    wf = r.wait_fraction
    loop = r.loop_cpu_share
    threads = r.settings.get("threads")
    readers = "the loader's thread" if threads == 1 else f"the loader's {threads or ''} threads".replace("  ", " ")
    one = threads == 1
    probe = (
        f"a thread that lets go of the GIL waits {r.gil_wait_p50_ms:.1f} ms to get it back "
        f"({percent(r.gil_busy)} of the probes waited half a switch interval or more)"
    )
    fix = (
        "use DataLoader(num_workers=...) worker processes instead of threads, or decode with the native kernel "
        "(DecodeBatch: one GIL hand-over a batch instead of several a sample)"
    )
    if wf >= _CALM:
        holder = (
            "the loop's own Python holds"
            if loop is None or loop >= _LOOP_RUNS / 2
            else "their own Python holds (it runs one thread at a time)"
        )
        return (
            f"Input-bound on the GIL: the loop waits {percent(wf)} of its time for data (p95 "
            f"{r.wait_p95_ms:.1f} ms) because {readers} {'waits' if one else 'wait'} for the GIL that {holder}: "
            f"{probe}. "
            f"More threads do not help: {fix}."
        )
    if loop is not None and loop >= _LOOP_RUNS:
        return None  # the loop ran all along: its own step sets the pace
    return (
        f"Held back by the GIL: the loop waits only {percent(wf)} of its time for data, but it waits for the GIL "
        f"that {readers} {'holds' if one else 'hold'} between C calls: {probe}, so each step's Python waits its turn "
        "and a faster "
        f"model would not help. Use fewer threads (Loader(threads=...)), or {fix}."
    )
