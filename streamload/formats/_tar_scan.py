"""Tar files written by other tools (``webdataset``, ``tar``): their members scanned, their sidecar built.

Only what a tar reader would extract as regular files becomes a sample's field: PAX and
GNU long-name headers are folded into their member, directories skipped; links, devices,
FIFOs, sparse members and oversized extended headers are refused (hostile input), as is
anything that is not a regular file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import xxhash

from .._errors import CorruptShardError
from ._record import open_regular_file
from ._tar_sidecar import MAX_MEMBER_BYTES, IndexBuilder, check_tar_field
from .base import MAX_KEY_BYTES, key_problem, unsafe

__all__ = [
    "BLOCK",
    "HEADER_SIZE_LIMIT",
    "MAX_EXTENDED_HEADER_BYTES",
    "ZERO_BLOCK",
    "LabelTally",
    "index_tar",
    "iter_members",
    "member_key_field",
    "pad",
    "parse_octal",
    "split_name",
]

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
#: A PAX or GNU long-name header larger than this is treated as hostile (they hold a name
#: and a few numbers).
MAX_EXTENDED_HEADER_BYTES = 1 << 20
#: Sizes from this on do not fit a tar header's octal field and are written in PAX records.
HEADER_SIZE_LIMIT = 8**11
#: Members are hashed in pieces of this size when indexed.
_HASH_PIECE = 16 << 20


def pad(n: int) -> int:
    """Bytes of padding after ``n`` bytes of member data (to the next 512-byte block)."""
    return (-n) % BLOCK


def parse_octal(field: bytes, where: str) -> int:
    """A tar header's numeric field (octal, or GNU base-256); ``where`` names it in the error."""
    if field[:1] and field[0] & 0x80:  # GNU base-256
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError as exc:
        raise CorruptShardError(f"{where}: bad numeric header field {field!r}") from exc


def _parse_pax(data: bytes, where: str) -> dict[str, str]:
    """Parse PAX records (``<length> <key>=<value>`` and a newline); anything malformed is corruption."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos:] == bytes(len(data) - pos):
            break  # NUL padding after the last record (some writers)
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() and digits.isascii() else 0  # at most 20 digits
        end = pos + length
        if length <= space + 1 - pos or end > len(data) or data[end - 1 : end] != b"\n":
            raise CorruptShardError(f"{where}: malformed PAX record at byte {pos} of its header")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not key or not eq:
            raise CorruptShardError(f"{where}: malformed PAX record at byte {pos} of its header")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _pax_size(value: str, where: str) -> int:
    """A PAX ``size`` value: decimal digits only (no sign, space or base prefix)."""
    if not (0 < len(value) <= 20 and value.isascii() and value.isdigit()):
        raise CorruptShardError(f"{where}: PAX size {value[:40]!r} is not a byte count")
    return int(value)


def _hash_range(fd: int, offset: int, size: int, where: str) -> int:
    """xxh3_64 of ``size`` bytes at ``offset``, read in pieces (a member may be larger than memory)."""
    if size <= _HASH_PIECE:
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise CorruptShardError(f"{where}: member is truncated")
        return xxhash.xxh3_64_intdigest(data)
    hasher = xxhash.xxh3_64()
    buf = bytearray(_HASH_PIECE)
    done = 0
    while done < size:
        view = memoryview(buf)[: min(_HASH_PIECE, size - done)]
        got = os.preadv(fd, [view], offset + done)
        if got != len(view):
            raise CorruptShardError(f"{where}: member is truncated")
        hasher.update(view)
        done += got
    return hasher.intdigest()


def iter_members(path: str, shard_name: str) -> Iterator[tuple[str, int, int, int]]:
    """Yield ``(name, header_offset, data_offset, size)`` for each regular member of a tar file.

    PAX (``x``, and global ``g``, applied to every later member as tar readers do) and
    GNU long-name (``L``) headers are folded into the member that follows; a PAX ``size``
    replaces the header's; directories are skipped. Links, device files, FIFOs, sparse
    members, names with NUL and extended headers over :data:`MAX_EXTENDED_HEADER_BYTES`
    raise :class:`UnsafeShardError` / :class:`CorruptShardError`; so does a shard that is
    not a regular file.
    """
    fd = open_regular_file(path, shard_name)
    try:
        yield from _members(fd, shard_name)
    finally:
        os.close(fd)


def _members(fd: int, shard_name: str) -> Iterator[tuple[str, int, int, int]]:
    total = os.fstat(fd).st_size
    pos = 0
    first_header: int | None = None
    pending: dict[str, str] = {}
    global_pax: dict[str, str] = {}
    if os.pread(fd, 2, 0) == b"\x1f\x8b":
        raise CorruptShardError(
            f"{shard_name} is gzip-compressed, not a plain tar: tar shards are read by byte offsets, which a gzip "
            f"stream does not have; decompress it first (`gunzip -c {shard_name} > plain.tar`) and index the .tar"
        )
    while pos + BLOCK <= total:
        block = os.pread(fd, BLOCK, pos)
        if block == ZERO_BLOCK:
            return
        where = f"{shard_name} at byte {pos}"
        stored = parse_octal(block[148:156], where)
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise CorruptShardError(f"{where}: tar header checksum mismatch")
        name = block[:100].split(b"\0", 1)[0]
        if block[257:262] == b"ustar" and block[345:500].strip(b"\0"):
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        size = parse_octal(block[124:136], where)
        kind = block[156:157]
        extended = kind in (b"x", b"L", b"g")
        pax = {**global_pax, **pending}
        if not extended and "size" in pax:
            pax_size = _pax_size(pax["size"], where)
            # Tar writers put a size in PAX only when the header cannot hold it (and write
            # 0 there); a PAX size that disagrees with a header that could hold it is damage.
            if pax_size != size and (size or pax_size < HEADER_SIZE_LIMIT):
                raise CorruptShardError(f"{where}: PAX size {pax_size} disagrees with the header's {size}")
            size = pax_size
        data_at = pos + BLOCK
        if size > MAX_MEMBER_BYTES or size > total - data_at:
            raise CorruptShardError(f"{where}: member size {size} runs past the end of the file")
        if extended and size > MAX_EXTENDED_HEADER_BYTES:
            raise unsafe(
                shard_name, f"extended header of {size} bytes at byte {pos} (at most {MAX_EXTENDED_HEADER_BYTES})"
            )
        if first_header is None:
            first_header = pos
        pos = data_at + size + pad(size)
        if extended:
            data = os.pread(fd, size, data_at)
            if kind == b"x":
                pending.update(_parse_pax(data, where))
            elif kind == b"g":
                global_pax.update(_parse_pax(data, where))
                first_header, pending = None, {}
            else:
                pending["path"] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind == b"5":
            first_header, pending = None, {}
            continue
        if kind not in (b"0", b"\0", b"7"):
            raise unsafe(
                shard_name,
                f"member {name!r} at byte {data_at - BLOCK} has type {kind!r} (links, devices and FIFOs are refused)",
            )
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise CorruptShardError(f"{where}: sparse member {name!r} (not supported)")
        full = pax.get("path") or name.decode("utf-8", "surrogateescape")
        if "\0" in full:
            raise unsafe(shard_name, f"member name {full!r} at byte {data_at - BLOCK} contains NUL")
        yield full, first_header, data_at, size
        first_header, pending = None, {}


def split_name(name: str) -> tuple[str, str] | None:
    """Split a member name into WebDataset ``(key, field)``.

    The field starts at the first dot of the last path component. Returns ``None`` if
    there is no such dot.
    """
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :]


def member_key_field(name: str, shard_name: str) -> tuple[str, str]:
    """The sample key and field of member ``name``, as a tar reader such as ``webdataset`` sees them.

    The name is normalised first: a leading ``./`` (what ``tar -C DIR -cf x.tar .`` writes)
    and empty or ``.`` path components (``a//b.jpg``, ``a/./b.jpg``) are dropped, since
    extracting the archive puts such members where the plain name would. The field
    (the suffix after the first dot of the last component) is lower-cased, as
    ``webdataset`` does: ``000.JPG`` is field ``jpg``.

    Raises:
        UnsafeShardError: For an absolute name, a ``..`` component, or a key that no
            reader would accept (naming the member).
        CorruptShardError: For a member without a suffix, or a key longer than
            ``MAX_KEY_BYTES``.
    """
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise unsafe(shard_name, f"member name {name!r} is absolute or contains '..' (it would escape an extraction)")
    plain = "/".join(p for p in parts if p not in ("", "."))
    found = split_name(plain)
    if found is None:
        raise CorruptShardError(f"{shard_name}: member {name!r} has no extension, so no sample field")
    key, field = found
    if len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
        raise CorruptShardError(f"{shard_name}: key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
    problem = key_problem(key)
    if problem is not None:
        raise unsafe(shard_name, f"member {name!r}: {problem}")
    return key, field.lower()


class LabelTally:
    """The integer labels of the ``cls`` members met while tar shards are indexed (for ``info``)."""

    def __init__(self) -> None:
        #: The distinct integer labels.
        self.values: set[int] = set()
        #: ``cls`` members that are not one decimal integer (then the labels are not class indices).
        self.other = 0

    def add(self, data: bytes) -> None:
        """Count one ``cls`` member's content."""
        text = data.strip()
        if 0 < len(text) <= 20 and text.isdigit():
            self.values.add(int(text))
        else:
            self.other += 1


def index_tar(path: str, shard_name: str, sidecar_out: str, tally: LabelTally | None = None) -> tuple[int, list[str]]:
    """Build the sidecar for a tar shard written by another tool (e.g. webdataset).

    Member names become keys and fields as :func:`member_key_field` says (``./000.JPG``
    is sample ``000``, field ``jpg``), so the sidecar holds only keys every reader takes.

    Returns:
        ``(num_samples, field_names)``; the sidecar is written to ``sidecar_out``. The
        ``cls`` members' labels are counted in ``tally`` when one is given.

    Raises:
        CorruptShardError: If a member has no extension, a sample's members are not
            adjacent, a field repeats within a sample, a key is longer than
            ``MAX_KEY_BYTES`` or a field name is one the readers refuse.
        UnsafeShardError: For absolute or ``..`` member names, keys with control
            characters, links and device files (naming the member).
    """
    builder = IndexBuilder()
    seen: set[str] = set()
    current: str | None = None
    current_fields: set[str] = set()
    end = 0
    fd = open_regular_file(path, shard_name)
    try:
        for name, header_at, data_at, size in iter_members(path, shard_name):
            key, field = member_key_field(name, shard_name)
            if key != current:
                if key in seen:
                    raise CorruptShardError(f"{shard_name}: members of sample {key!r} are not adjacent")
                seen.add(key)
                current, current_fields = key, set()
                builder.start_sample(key, header_at)
            if field in current_fields:
                raise CorruptShardError(
                    f"{shard_name}: sample {key!r} has field {field!r} twice (member {name!r}; suffixes are "
                    "compared lower-cased, as webdataset reads them)"
                )
            if field not in builder.names:
                check_tar_field(field, f"{shard_name}: member {name!r}")
            current_fields.add(field)
            digest = _hash_range(fd, data_at, size, f"{shard_name}: member {name!r}")
            builder.add_member(field, data_at, size, digest)
            if tally is not None and field == "cls":
                tally.add(os.pread(fd, min(size, 64), data_at) if size <= 64 else b"")
            end = data_at + size + pad(size)
    finally:
        os.close(fd)
    with open(sidecar_out, "wb") as out:
        out.write(builder.to_bytes(end))
    return len(builder.sample_start), builder.fields
