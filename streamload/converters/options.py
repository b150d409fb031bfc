"""What a conversion is asked to do (:class:`ConvertOptions`) and what it did (:class:`ConvertReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from streamload._errors import ConfigError
from streamload._units import counted, parse_bytes
from streamload.formats import get_format
from streamload.manifest import HASH_ALGORITHMS, Manifest, SkippedInput

from .executors import parse_executor

__all__ = ["DEFAULT_SHARD_BYTES", "MAX_WORKERS", "ConvertOptions", "ConvertReport"]

DEFAULT_SHARD_BYTES = 128 * 10**6
#: Most conversion processes accepted (each is a full process; more only thrash).
MAX_WORKERS = 1024


@dataclass(frozen=True)
class ConvertOptions:
    """Options of a conversion.

    Attributes:
        format: Shard format name.
        shard_bytes: Payload bytes per shard at most (ignored if ``samples_per_shard``).
        samples_per_shard: Samples per shard at most.
        workers: Conversion processes (output is identical for any value).
        shuffle: Shuffle the sample order before sharding.
        seed: Seed of that shuffle.
        on_error: ``"raise"`` at the first broken input, or ``"skip"`` it (listed in the
            manifest and counted).
        hash_algorithm: Shard hash algorithm (``"xxh3_128"`` or ``"sha256"``); ``None``: xxh3_128
            for a new dataset (:data:`~streamload.manifest.DEFAULT_HASH_ALGORITHM`), the
            dataset's own when appending.
        progress: Show a progress bar: ``True``, ``False`` or ``None`` (only on a terminal).
        storage_options: fsspec options for a remote destination.
        resume: Finish an interrupted conversion, reusing the shards it published.
        overwrite: Replace a dataset or an interrupted conversion at the destination.
        executor: Where shard tasks run: ``"local"`` (a process pool of ``workers``),
            ``"dask"`` / ``"dask://HOST:PORT"``, ``"ray"`` / ``"ray://HOST:PORT"``
            (see :mod:`.executors`). The output is the same for every executor.
        append: Add the source's samples as new shards to the dataset at the destination.
    """

    format: str = "tar"
    shard_bytes: int | str | None = DEFAULT_SHARD_BYTES
    samples_per_shard: int | None = None
    workers: int = 1
    shuffle: bool = False
    seed: int = 0
    on_error: Literal["raise", "skip"] = "raise"
    hash_algorithm: str | None = None
    progress: bool | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    overwrite: bool = False
    executor: str = "local"
    append: bool = False

    def validate(self) -> None:
        """Raise :class:`~streamload.ConfigError` for impossible values."""
        if not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers={self.workers!r} must be between 1 and {MAX_WORKERS}")
        if self.samples_per_shard is not None and (
            not isinstance(self.samples_per_shard, int) or self.samples_per_shard < 1
        ):
            raise ConfigError(f"samples_per_shard={self.samples_per_shard!r} must be >= 1")
        max_bytes = self.max_shard_bytes()
        if self.samples_per_shard is None and max_bytes is not None and max_bytes < 1:
            raise ConfigError(f"shard_bytes={self.shard_bytes!r} must be at least 1 byte")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be an integer >= 0")
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={self.on_error!r} must be 'raise' or 'skip'")
        if self.hash_algorithm is not None and self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(f"hash_algorithm={self.hash_algorithm!r} must be one of {HASH_ALGORITHMS}")
        get_format(self.format)
        parse_executor(self.executor)
        if self.append and self.overwrite:
            raise ConfigError("append and overwrite exclude each other: --append keeps the dataset it adds to")

    def max_shard_bytes(self) -> int | None:
        """Return ``shard_bytes`` as a number of bytes (``None``: no byte limit).

        Raises:
            ConfigError: If it is not a byte size.
        """
        if self.shard_bytes is None:
            return None
        try:
            return parse_bytes(self.shard_bytes, name="shard_bytes")
        except (OverflowError, ValueError) as exc:  # a size too large for a float
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"shard_bytes={self.shard_bytes!r} is not a usable byte size") from exc


@dataclass
class ConvertReport:
    """What a conversion did.

    Attributes:
        manifest: The manifest written (or found, if ``already_complete``).
        seconds: Wall time of the call.
        payload_bytes: Payload bytes written by this call.
        ignored: Files of the source that are not inputs.
        resumed: Shards reused from an interrupted run.
        already_complete: ``--resume`` found this very conversion complete: nothing was written.
        warnings: Library warnings (truncated or malformed files, TIFF tags...) raised
            while checking inputs that were kept, each with its input.
        twins: Inputs and class folders whose names differ from another's only in Unicode
            normalization (NFC and NFD ``café``): kept, each listed with why.
    """

    manifest: Manifest
    seconds: float
    payload_bytes: int
    ignored: list[SkippedInput]
    resumed: int = 0
    already_complete: bool = False
    warnings: list[SkippedInput] = field(default_factory=list)
    twins: list[SkippedInput] = field(default_factory=list)

    @property
    def skipped(self) -> tuple[SkippedInput, ...]:
        """Inputs skipped because they were broken (under ``on_error="skip"``)."""
        return self.manifest.skipped

    def skip_counts(self) -> str:
        """What was left out, each kind counted apart: broken inputs, empty class folders, other folders, non-inputs."""
        folders = [s for s in self.skipped if s.path.endswith("/")]
        empty = sum(1 for s in folders if s.error.startswith("empty class folder"))
        parts = [f"{counted(len(self.skipped) - len(folders), 'broken input')} skipped"]
        if empty:
            parts.append(counted(empty, "empty class folder"))
        if len(folders) > empty:
            parts.append(f"{counted(len(folders) - empty, 'unreadable folder')} skipped")
        parts.append(f"{counted(len(self.ignored), 'non-input file')} ignored")
        return ", ".join(parts)

    def summary(self) -> str:
        """Return a one-paragraph human summary."""
        m = self.manifest
        held = f"{counted(m.num_samples, 'sample')} in {counted(len(m.shards), f'{m.format} shard')}"
        if self.already_complete:
            return (
                f"nothing to do: the destination already holds this conversion, complete "
                f"({held}, {m.num_bytes / 1e6:.1f} MB)"
            )
        rate = self.payload_bytes / max(self.seconds, 1e-9) / 1e6
        return (
            f"wrote {held} "
            f"({m.num_bytes / 1e6:.1f} MB) in {self.seconds:.2f} s: "
            f"{m.num_samples / max(self.seconds, 1e-9):.0f} samples/s, {rate:.1f} MB/s; "
            + self.skip_counts()
            + (f", {counted(len(self.warnings), 'library warning')}" if self.warnings else "")
            + (f", {counted(len(self.twins), 'Unicode normalization twin')}" if self.twins else "")
            + (f"; {counted(self.resumed, 'shard')} reused from the interrupted run" if self.resumed else "")
        )
