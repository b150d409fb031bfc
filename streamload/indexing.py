"""Indexing shards written by other tools: ``streamload index``.

Tar shards written by the ``webdataset`` package (or ``tar`` itself) become a streamload
dataset in place: each shard gets its sidecar (offsets, sizes, checksums), and
``index.json`` is written last. The shards themselves are never rewritten. A directory
or any fsspec URL prefix (each remote shard is downloaded to a temporary file, one at a
time, and its sidecar uploaded beside it).

Parquet files (``format="parquet"``, e.g. a Hugging Face dataset's
``data/train-*.parquet``), and any format's tables read in place (:attr:`Format.tables
<streamload.formats.Format>`, see :mod:`streamload.formats.parquet`), are indexed the
same way: every file is checked whole first, and only when all of them fit the sample
model are the sidecars and ``index.json`` published, so bad input leaves nothing written.

Where the files' folder or bucket is read-only (someone else's), ``output=`` (``streamload
index SRC --format parquet --output DST``) writes ``index.json`` and the sidecars to
``DST`` instead; the manifest's ``data_root`` names ``SRC`` (an absolute path or the URL)
and readers of ``DST`` read the files in place there. Nothing is written to ``SRC``.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ._classes import long_name, repeated, shown
from ._errors import ConfigError, ShardNotFoundError
from ._files import DEFAULT_HASH_ALGORITHM, FileEntry, hash_file
from ._validate import check_on_error
from .formats import Format, get_format
from .formats._tar_scan import LabelTally, index_tar
from .manifest import MANIFEST_NAME, ForeignManifestError, Manifest, ShardEntry, SkippedInput, check_data_root
from .storage import Destination, is_local, local_path_of
from .storage.transport import open_transport
from .storageconfig import StorageConfig

__all__ = ["INDEXED_BY", "index_directory", "index_shard", "publish_index"]

#: ``meta["indexed_by"]`` of every manifest ``index`` writes: the only kind ``overwrite=True`` replaces.
INDEXED_BY = "streamload index"
#: How a split is named (``--split``): a folder name of letters, digits, ``_``, ``-`` and ``.``.
_SPLIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def index_directory(
    url: str,
    format: str = "tar",
    hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
    classes: tuple[str, ...] = (),
    storage_options: Mapping[str, Any] | None = None,
    match: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    output: str | None = None,
    *,
    overwrite: bool = False,
    split: str | None = None,
    on_error: str = "raise",
    files: Sequence[str] | None = None,
) -> Manifest:
    """Write ``index.json`` (and sidecars) for shards written by another tool, in place.

    Every ``*.tar`` (``*.parquet``) file of the directory or URL prefix, in sorted name
    order, becomes a shard. The shards themselves are not rewritten.

    An ``index.json`` already at the destination is replaced only with ``overwrite`` and
    only if ``index`` wrote it (its ``meta["indexed_by"]``): a dataset ``convert`` wrote,
    or anyone else's manifest, is never replaced.

    Splits side by side (the Hugging Face layout, ``train-*.parquet`` and
    ``test-*.parquet`` in one folder): ``split="train"`` indexes the files matching
    ``train[-.]*`` (unless ``match`` says otherwise) into the sub-folder ``train/`` (its
    ``index.json`` and sidecars; ``data_root`` names the folder of the files), so each split
    is a dataset of its own: ``StreamingDataset("DIR/train")``.

    Args:
        url: The directory or URL prefix holding the shards.
        format: ``"tar"`` or ``"parquet"``.
        hash_algorithm: Hash of the manifest entries.
        classes: Class names to record (Parquet: taken from a Hugging Face ``ClassLabel``
            when not given).
        storage_options: fsspec options.
        match: Only files whose names match this glob (e.g. ``"train-*.parquet"``).
        image_column: Parquet: the image column (default: found from the schema).
        label_column: Parquet: the label column (default: ``label`` or the
            ``ClassLabel``; ``""``: none).
        output: Write ``index.json`` and the sidecars to this directory or URL instead,
            the manifest naming ``url`` as its ``data_root`` (for files in a read-only
            place, or a folder holding another tool's ``index.json``). ``url`` is then
            only read. A remote output cannot name local files.
        overwrite: Replace an index this function wrote before at the destination.
        split: Parquet: index one split into the sub-folder ``url/split`` (see above).
        on_error: Parquet: ``"raise"`` on a bad row, or ``"skip"`` it: the row is left
            out, listed in the manifest's ``skipped``, and readers yield the others.
        files: Exactly these file names of the folder, in this order (instead of every
            ``*.tar`` / ``*.parquet`` file in name order); each must exist.

    Raises:
        ConfigError: If the format cannot be indexed, the directory holds no shard, the
            destination holds an index that may not be replaced (see above), an entry is
            not a regular file, a class name is given twice, or (Parquet) a file does not
            fit the sample model (naming file, column and row).
        DestinationBusyError: If a conversion or another writer holds the directory.
    """
    fmt = get_format(format)
    tables = fmt.tables
    if fmt.indexer is None and tables is None:
        raise ConfigError(f"format {format!r} cannot index shards written by other tools")
    _check_classes(classes)
    if match is not None and not match:
        raise ConfigError("--match '' matches no file name: give a glob such as 'train-*.parquet'")
    check_on_error(on_error)
    if on_error == "skip" and tables is None:
        raise ConfigError(
            f"--on-error skip leaves out bad rows of tables read in place (parquet); "
            f"a {fmt.name} shard is indexed whole"
        )
    if split is not None:
        if tables is None:
            raise ConfigError(f"--split is for tables read in place (parquet), not {fmt.name}")
        if not _SPLIT.fullmatch(split):
            raise ConfigError(f"--split {split!r}: a split name is letters, digits, '_', '-' and '.'")
        if output is None:
            output = os.path.join(url, split) if is_local(url) else f"{url.rstrip('/')}/{split}"
        if match is None:
            match = f"{split}[-.]*"
    if is_local(url) and os.path.isfile(local_path_of(url)):
        raise ConfigError(f"{url} is a file: index takes the folder holding it (--match NAME to index only this file)")
    if output is not None and is_local(output) and os.path.lexists(local_path_of(output)):
        if not os.path.isdir(local_path_of(output)):
            raise ConfigError(f"--output {output} is not a folder (the index and its sidecars are written into one)")
    source = _Source(url, storage_options)
    data_root = None
    if output is not None and not source.same_place(output):
        if is_local(url) and not is_local(output):
            raise ConfigError(f"{output}: a remote index cannot name the local files of {url}")
        data_root = source.root()
    target = url if data_root is None else str(output)
    dest = StorageConfig(storage_options=storage_options).open_destination(target)
    try:
        with dest.lock() as lock:  # one writer at a time, as for a conversion
            _check_existing(dest, target, overwrite)
            where = local_path_of(url) if is_local(url) else url
            listed = source.list_names()
            if files is not None:
                names = _named_files(listed, files, where)
            else:
                names = [n for n in listed if not n.startswith(".")]
                if match is not None:
                    names = [n for n in names if fnmatch.fnmatchcase(n, match)]
                _refuse_compressed(fmt, names, where, local=is_local(url))
                names = [n for n in names if n.endswith(fmt.extension)]
            if not names:
                from ._hf import saved_to_disk

                saved = saved_to_disk(local_path_of(url)) if is_local(url) else None
                if saved is not None:
                    raise ConfigError(saved)
                pattern = match if match is not None else f"*{fmt.extension}"
                raise ConfigError(f"{where}: no {pattern} files to index{_other_files(fmt, listed, match, where)}")
            meta: dict[str, Any] = {"indexed_by": INDEXED_BY}
            if split is not None:
                meta["split"] = split
            if match is not None:
                meta["match"] = match
            if tables is not None:
                source.check_regular(names, tables.kind)
                return _index_tables(
                    source,
                    dest,
                    fmt,
                    names,
                    hash_algorithm,
                    classes,
                    image_column,
                    label_column,
                    lock,
                    data_root,
                    on_error,
                    meta,
                )
            tally = LabelTally()
            indexed = [_index_one(fmt, source, dest, name, hash_algorithm, tally) for name in names]
            labels = _labels_meta(tally, classes)
            if labels is not None:
                meta["labels"] = labels
            lock.check()
            return publish_index(dest, fmt, indexed, hash_algorithm, classes, data_root, meta=meta)
    finally:
        dest.close()


def _check_classes(classes: tuple[str, ...]) -> None:
    """Refuse class names given twice (``--classes a,a``) or longer than a class name may be."""
    twice = repeated(classes)
    if twice:
        raise ConfigError(f"--classes names class {shown(twice[0])!r} more than once (each class is one label)")
    too_long = long_name(classes)
    if too_long is not None:
        raise ConfigError(f"--classes: {too_long}")


def _check_existing(dest: Destination, where: str, overwrite: bool) -> None:
    """Refuse to replace an ``index.json`` at ``dest``, unless ``index`` wrote it and ``overwrite`` says so."""
    if dest.exists(MANIFEST_NAME) is None:
        return
    whose = "another dataset's"
    try:
        found: Manifest | None = Manifest.loads(dest.read_bytes(MANIFEST_NAME))
    except ForeignManifestError as exc:  # MDS, LitData: named
        found, whose = None, f"{exc.kind}'s"
    except Exception:  # unreadable: someone else's, in any case not ours
        found = None
    if found is not None and found.meta.get("indexed_by") == INDEXED_BY:
        if overwrite:
            return
        split = found.meta.get("split")
        what = f"split {split!r}" if isinstance(split, str) else f"{len(found.shards)} {found.format} file(s)"
        raise ConfigError(
            f"{where} already holds an index ({MANIFEST_NAME} of {what}, written by streamload index): "
            "--overwrite replaces it; to index another split of the same folder beside it, use --split NAME "
            "(its index goes to the sub-folder NAME)"
        )
    if found is not None and "converter" in found.meta:
        raise ConfigError(
            f"{where} holds a dataset written by streamload convert ({found.num_samples} samples, "
            f"{len(found.classes)} classes): it is read as it is and needs no index; indexing it would replace "
            "its manifest (classes and meta). Nothing was written"
        )
    raise ConfigError(
        f"{where} holds {whose} {MANIFEST_NAME} (not one streamload index wrote): index never "
        "replaces it, --overwrite or not; write the index elsewhere (--output DIR)"
    )


class _Source:
    """The files being indexed, only read (a local folder or a URL prefix)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.url = str(url)
        self.files = None
        if not is_local(self.url):
            settings = StorageConfig(storage_options=storage_options).resolve()
            self.files = open_transport(self.url.rstrip("/"), settings)

    def root(self) -> str:
        """The ``data_root`` naming this place: an absolute path, or the URL."""
        if self.files is None:
            return check_data_root(os.path.abspath(local_path_of(self.url)))
        return check_data_root(self.url.rstrip("/"))

    def same_place(self, other: str) -> bool:
        """Whether ``other`` names this folder or prefix."""
        if is_local(self.url) != is_local(other):
            return False
        if self.files is None:
            a, b = local_path_of(self.url), local_path_of(other)
            return os.path.realpath(a) == os.path.realpath(b)
        return self.url.rstrip("/") == other.rstrip("/")

    def list_names(self) -> list[str]:
        """The sorted names of the files directly in the folder or under the prefix."""
        if self.files is None:
            path = local_path_of(self.url)
            return sorted(os.listdir(path)) if os.path.isdir(path) else []
        try:
            return self.files.list_names()
        except ShardNotFoundError:
            return []

    def check_regular(self, names: list[str], kind: str) -> None:
        """Refuse (local files) a name that is a folder, a FIFO, a socket or a device: never opened."""
        if self.files is not None:
            return
        for name in names:
            try:
                mode = os.stat(os.path.join(local_path_of(self.url), name)).st_mode
            except OSError as exc:
                raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from exc
            if stat.S_ISDIR(mode):
                raise ConfigError(f"{name}: a directory, not a {kind} file (leave it out with --match)")
            if not stat.S_ISREG(mode):
                raise ConfigError(f"{name}: not a regular file (a FIFO, socket or device): not read")

    def local_copy(self, dest: Destination, name: str) -> tuple[str, bool]:
        """A local path of file ``name``, and whether it is a downloaded copy (staged at ``dest``, to discard)."""
        if self.files is None:
            return os.path.join(local_path_of(self.url), name), False
        local = dest.staging_path(name)
        try:
            self.files.download(name, local, lambda: False)
        except BaseException:
            dest.discard(local)
            raise
        return local, True


def _index_tables(
    source: _Source,
    dest: Destination,
    fmt: Format,
    names: list[str],
    hash_algorithm: str | None,
    classes: tuple[str, ...],
    image_column: str | None,
    label_column: str | None,
    lock: Any,
    data_root: str | None,
    on_error: str,
    meta: dict[str, Any],
) -> Manifest:
    """Index tables read in place: every file checked and its sidecar staged before anything is published."""
    tables = fmt.tables
    assert tables is not None
    staged: list[tuple[str, str]] = []  # (staged sidecar, its name)
    found: list[tuple[ShardEntry, list[str]]] = []
    label_names: list[tuple[str, ...] | None] = []  # per file: its string labels, else None
    names_of_classes: tuple[str, ...] | None = None
    first_with_classes = ""
    skipped: list[SkippedInput] = []
    try:
        for name in sorted(names):
            sidecar_name = fmt.sidecar_name(name)
            assert sidecar_name is not None
            out = dest.staging_path(sidecar_name)
            staged.append((out, sidecar_name))
            local, remote = source.local_copy(dest, name)
            try:
                info = tables.index(
                    local,
                    name,
                    out,
                    image_column=image_column,
                    label_column=label_column,
                    num_classes=len(classes) if classes else None,
                    on_error=on_error,
                )
                skipped.extend(SkippedInput(f"{name}: row {row}", why) for row, why in info.skipped)
                digest, size = hash_file(local, hash_algorithm)
            finally:
                if remote:
                    dest.discard(local)
            if info.classes is not None:
                if names_of_classes is None:
                    names_of_classes, first_with_classes = info.classes, name
                elif info.classes != names_of_classes:
                    raise ConfigError(
                        f"{name}: its ClassLabel names differ from those of {first_with_classes}: "
                        "the files are not one dataset (index them apart, or --match one split)"
                    )
            label_names.append(info.label_names)
            sidecar = FileEntry(sidecar_name, 0, None)  # sized and hashed once its labels are final
            entry = ShardEntry(name=name, num_bytes=size, hash=digest, num_samples=info.num_samples, sidecar=sidecar)
            found.append((entry, info.fields))
        kinds = {("cls" in f, "json" in f) for _, f in found}
        if len(kinds) > 1:
            raise ConfigError(
                "the files do not share their columns (some have labels or other columns, some not); "
                "index them apart with --match"
            )
        mappings, label_classes = _string_labels(names, label_names, classes)
        final: list[tuple[ShardEntry, list[str]]] = []
        for (out, sidecar_name), (entry, fields), mapping in zip(staged, found, mappings, strict=True):
            if mapping is not None:
                tables.relabel(out, mapping)
            s_hash, s_size = hash_file(out, hash_algorithm)
            final.append((replace(entry, sidecar=FileEntry(sidecar_name, s_size, s_hash)), fields))
        found = final
        lock.check()
        for out, sidecar_name in staged:
            dest.commit(out, sidecar_name)
        staged = []
    finally:
        for out, _ in staged:
            dest.discard(out)
    classes = classes or label_classes
    return publish_index(
        dest, fmt, found, hash_algorithm, classes or names_of_classes or (), data_root, skipped=skipped, meta=meta
    )


def _string_labels(
    names: list[str], label_names: list[tuple[str, ...] | None], classes: tuple[str, ...]
) -> tuple[list[list[int] | None], tuple[str, ...]]:
    """The dataset's labels for files labelled by strings, as ``convert`` reads such a column.

    Every label a decimal integer: they are class indices (``>= 0``). Otherwise every label
    is a class name; the names, sorted (or ``classes`` when given, which must hold them
    all), are numbered. Returns, per file, the map from its sorted names to labels (``None``
    for integer columns), and the class names found.

    Raises:
        ConfigError: Naming the file, for integer and string label columns mixed, a
            negative index, or a name missing from ``classes``.
    """
    with_names = [n for n, found in zip(sorted(names), label_names, strict=True) if found is not None]
    if not with_names:
        return [None] * len(label_names), ()
    if len(with_names) != len(label_names):
        plain = next(n for n, found in zip(sorted(names), label_names, strict=True) if found is None)
        raise ConfigError(
            f"{with_names[0]}: its labels are strings, those of {plain} integers: "
            "the files are not one dataset (index them apart with --match)"
        )
    everything = sorted({v for found in label_names if found is not None for v in found})
    if all(re.fullmatch(r"-?[0-9]+", v.strip()) for v in everything):
        for file_name, found in zip(sorted(names), label_names, strict=True):
            assert found is not None
            negative = [v for v in found if int(v) < 0]
            if negative:
                raise ConfigError(f"{file_name}: label {negative[0].strip()} is negative (labels are class indices)")
        return [[int(v) for v in found] if found is not None else None for found in label_names], ()
    table = list(classes) if classes else everything
    position = {c: i for i, c in enumerate(table)}
    for file_name, found in zip(sorted(names), label_names, strict=True):
        missing = [v for v in found or () if v not in position]
        if missing:
            raise ConfigError(f"{file_name}: label {missing[0]!r} is not one of the --classes given")
    mappings: list[list[int] | None] = [[position[v] for v in found or ()] for found in label_names]
    return mappings, tuple(table)


def _index_one(
    fmt: Format, source: _Source, dest: Destination, name: str, hash_algorithm: str | None, tally: LabelTally
) -> tuple[ShardEntry, list[str]]:
    """Index shard ``name`` of ``source`` (a remote one through a downloaded copy); its sidecar goes to ``dest``."""
    local, remote = source.local_copy(dest, name)
    try:
        if fmt.indexer is index_tar:  # tar: its cls labels counted too
            fmt = replace(fmt, indexer=lambda path, shard, out: index_tar(path, shard, out, tally))
        return index_shard(fmt, dest, local, name, hash_algorithm)
    finally:
        if remote:
            dest.discard(local)


def _labels_meta(tally: LabelTally, classes: tuple[str, ...]) -> dict[str, Any] | None:
    """``meta["labels"]`` of tar shards whose ``cls`` members are integers: how many distinct, lowest, highest.

    Raises:
        ConfigError: If ``classes`` are given and a label is not one of their indices.
    """
    if not tally.values or tally.other:
        return None
    low, high = min(tally.values), max(tally.values)
    if classes and high >= len(classes):
        raise ConfigError(
            f"a cls label is {high}, but --classes names {len(classes)} classes (labels 0 to {len(classes) - 1})"
        )
    return {"field": "cls", "distinct": len(tally.values), "min": low, "max": high}


#: Suffixes of gzip-compressed tar files (``webdataset`` reads them as a stream).
COMPRESSED_TAR = (".tar.gz", ".tgz")


def _refuse_compressed(fmt: Format, names: list[str], where: str, *, local: bool) -> None:
    """Refuse a folder holding gzip-compressed tar shards, in one line saying how to decompress them.

    A tar shard is read by the byte offsets of its members (its sidecar), which a gzip
    stream does not have; leaving such files out would lose their samples unsaid.
    """
    if fmt.name != "tar":
        return
    found = [n for n in names if n.lower().endswith(COMPRESSED_TAR)]
    if not found:
        return
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    suffixes = sorted({".tgz" if n.lower().endswith(".tgz") else ".tar.gz" for n in found})
    if local:
        files = " ".join(os.path.join(where, "*" + s) for s in suffixes)
        how = f"`gunzip {files}` (each becomes a .tar), then index again"
    else:
        how = "download, `gunzip` and upload them as .tar files, then index again"
    raise ConfigError(
        f"{where}: {found[0]}{more} is gzip-compressed; tar shards are read by byte offsets, which a gzip "
        f"stream does not have: decompress them first, {how}; or read them as a list of shards, "
        f"StreamingDataset('{where.rstrip('/')}/{found[0]}') or a brace pattern, which decompresses them "
        "into the cache"
    )


def _other_files(fmt: Format, listed: list[str], match: str | None, where: str) -> str:
    """What to do with a folder holding no file to index, by what it holds (``""``: nothing to say)."""
    visible = [n for n in listed if not n.startswith(".") and n != MANIFEST_NAME]
    if match is None:
        other = "parquet" if fmt.name == "tar" else "tar"
        if any(n.endswith("." + other) for n in visible):
            return f"; it holds {other} files: --format {other}"
    elif any(n.endswith(fmt.extension) for n in visible):
        return f"; it holds {fmt.extension} files that --match {match!r} leaves out"
    if not visible:
        return " (the folder is empty)"
    return f"; for a folder of images, `streamload convert {where} OUT_DIR` makes a dataset of them"


def _named_files(listed: list[str], files: Sequence[str], where: str) -> list[str]:
    """The files of a shard list, in the order given; each must be in the folder's listing, once."""
    present = set(listed)
    missing = [n for n in files if n not in present]
    if missing:
        more = f" ({len(missing)} missing)" if len(missing) > 1 else ""
        raise ShardNotFoundError(f"{where}/{missing[0]} does not exist{more}")
    seen: set[str] = set()
    for name in files:
        if name in seen:
            raise ConfigError(f"{where}/{name} is named twice in the list of shards")
        seen.add(name)
    return list(files)


def index_shard(
    fmt: Format, dest: Destination, path: str, name: str, hash_algorithm: str | None
) -> tuple[ShardEntry, list[str]]:
    """Index one shard written by another tool: build and publish its sidecar at ``dest``.

    Args:
        fmt: The shard's format (with an indexer).
        dest: Where the dataset is (the sidecar is committed there).
        path: A local copy of the shard.
        name: The shard's file name in the dataset.
        hash_algorithm: Hash for the manifest entries, or ``None``.

    Returns:
        The shard's manifest entry and its field names.
    """
    assert fmt.indexer is not None
    sidecar_name = fmt.sidecar_name(name)
    staged = dest.staging_path(sidecar_name or name + ".idx")
    try:
        count, fields = fmt.indexer(path, name, staged)
    except BaseException:
        dest.discard(staged)
        raise
    sidecar = None
    if sidecar_name is not None:
        s_hash, s_size = hash_file(staged, hash_algorithm)
        dest.commit(staged, sidecar_name)
        sidecar = FileEntry(sidecar_name, s_size, s_hash)
    else:
        dest.discard(staged)
    digest, size = hash_file(path, hash_algorithm)
    return ShardEntry(name=name, num_bytes=size, hash=digest, num_samples=count, sidecar=sidecar), fields


def publish_index(
    dest: Destination,
    fmt: Format,
    indexed: list[tuple[ShardEntry, list[str]]],
    hash_algorithm: str | None,
    classes: tuple[str, ...],
    data_root: str | None = None,
    *,
    skipped: list[SkippedInput] | None = None,
    meta: dict[str, Any] | None = None,
) -> Manifest:
    """Write ``index.json`` for shards indexed with :func:`index_shard`; return it.

    ``data_root``: where the files are; ``skipped``: rows left out; ``meta``: recorded in
    the manifest (``indexed_by`` always).
    """
    fields = sorted({f for _, shard_fields in indexed for f in shard_fields})
    manifest = Manifest(
        format=fmt.name,
        shards=tuple(entry for entry, _ in indexed),
        fields=tuple(fields),
        classes=classes,
        hash_algorithm=hash_algorithm,
        skipped=tuple(skipped or ()),
        meta={**(meta or {}), "indexed_by": INDEXED_BY},
        data_root=data_root,
    )
    dest.write_bytes(MANIFEST_NAME, manifest.dumps())
    return manifest
