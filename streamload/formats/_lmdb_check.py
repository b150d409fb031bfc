"""A structural check of an LMDB file, in Python, before LMDB itself reads it.

LMDB trusts its pages: a damaged page number or node can make it read outside the map
and crash the process. Shards written by streamload have a simple shape (one main
database, no duplicates, no sub-databases, written in one transaction), so before an
environment is opened its B-tree is walked here with ``os.pread``, checking everything
LMDB will follow when reading: the meta page it picks, the page size, each page's
header and bounds, every node's offset and size inside its page, every child and
overflow page number, that each overflow value fits in its pages, and that no page is
used twice (two records sharing one value, or a value made of B-tree pages).

What is checked mirrors LMDB 0.9's on-disk layout (``mdb.c``)::

    page     u64 pgno | u16 pad | u16 flags | u16 lower, u16 upper (or u32 overflow pages) | u16 ptrs[]
    node     u16 lo | u16 hi | u16 flags | u16 ksize | key | data   (branch: pgno = lo | hi<<16 | flags<<32)
    meta     page header, then u32 magic, u32 version, u64 address, u64 mapsize,
             2 x db {u32 pad (free db: page size), u16 flags, u16 depth, u64 branch, leaf,
             overflow pages, u64 entries, u64 root}, u64 last_pgno, u64 txnid

Cost: one read of each branch and leaf page plus 16 bytes per overflow value, once per
opened shard (well under a millisecond per thousand samples).
"""

from __future__ import annotations

import os
import struct

from .._errors import CorruptShardError
from ._record import open_regular_file

__all__ = ["check_lmdb_file"]

_PAGE = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_OVERFLOW_PAGES = struct.Struct("<I")
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("<QQ")  # last_pgno, txnid
_HEADER = 16
_MAGIC = 0xBEEFC0DE
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_F_BIGDATA = 0x01
_P_INVALID = 2**64 - 1


class _Walk:
    def __init__(self, fd: int, name: str, file_size: int) -> None:
        self.fd, self.name, self.file_size = fd, name, file_size
        self.psize = 0
        self.last = 0
        self.overflow: list[tuple[int, int]] = []  # (first page, page count) of every overflow value

    def fail(self, what: str) -> CorruptShardError:
        return CorruptShardError(f"{self.name}: LMDB structure is damaged ({what})")

    def read(self, pgno: int, size: int) -> bytes:
        data = os.pread(self.fd, size, pgno * self.psize)
        if len(data) != size:
            raise self.fail(f"page {pgno} is past the end of the file")
        return data

    def meta(self) -> tuple[int, int]:
        """Pick the meta page LMDB picks (largest txnid); return (main db root, flags)."""
        best: tuple[int, int, int, int] | None = None  # txnid, last page, main root, main flags
        for index in range(2):
            raw = os.pread(self.fd, _HEADER + _META.size + 2 * _DB.size + _TAIL.size, index * self.guess_psize())
            if len(raw) < _HEADER + _META.size + 2 * _DB.size + _TAIL.size:
                raise self.fail("meta page missing")
            flags = _PAGE.unpack_from(raw)[2]
            magic, version, _, _ = _META.unpack_from(raw, _HEADER)
            free_db = _DB.unpack_from(raw, _HEADER + _META.size)
            main_db = _DB.unpack_from(raw, _HEADER + _META.size + _DB.size)
            last, txnid = _TAIL.unpack_from(raw, _HEADER + _META.size + 2 * _DB.size)
            if not flags & _P_META or magic != _MAGIC or version != 1:
                raise self.fail(f"meta page {index} has a bad header")
            psize = free_db[0]
            if psize != self.guess_psize():
                raise self.fail(f"page size {psize}")
            if best is None or txnid > best[0]:
                best = (txnid, last, main_db[7], main_db[1])
        assert best is not None
        self.last = best[1]
        if (self.last + 1) * self.psize > self.file_size:
            raise self.fail(f"{self.last + 1} pages do not fit in {self.file_size} bytes")
        return best[2], best[3]

    def guess_psize(self) -> int:
        if not self.psize:
            raw = os.pread(self.fd, _HEADER + _META.size + _DB.size, 0)
            if len(raw) < _HEADER + _META.size + _DB.size:
                raise self.fail("file too short for a meta page")
            psize = _DB.unpack_from(raw, _HEADER + _META.size)[0]
            if psize < 512 or psize > 65536 or psize & (psize - 1):
                raise self.fail(f"page size {psize}")
            self.psize = psize
        return self.psize

    def page_number(self, pgno: int, what: str) -> int:
        if not 2 <= pgno <= self.last:
            raise self.fail(f"{what} points to page {pgno} (pages 2..{self.last})")
        return pgno

    def walk(self, root: int) -> None:
        seen: set[int] = set()
        todo = [self.page_number(root, "main database root")]
        while todo:
            pgno = todo.pop()
            if pgno in seen:
                raise self.fail(f"page {pgno} is reached twice")
            seen.add(pgno)
            todo.extend(self.page(pgno))
        self.disjoint(seen)

    def disjoint(self, tree: set[int]) -> None:
        """Check no page is used twice: by two overflow values, or by an overflow value and the tree.

        Otherwise several records could read one value (n records of one large value: n
        times the shard's bytes for a batch), or a value could be made of B-tree pages.
        """
        runs = sorted([(p, 1) for p in tree] + self.overflow)
        end = 0
        for first, pages in runs:
            if first < end:
                raise self.fail(f"overflow page {first} ({pages} pages) is used twice")
            end = first + pages

    def page(self, pgno: int) -> list[int]:
        """Check one branch or leaf page; return its child pages."""
        page = self.read(pgno, self.psize)
        _, _, flags, lower, upper = _PAGE.unpack_from(page)
        kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META)
        if kind not in (_P_BRANCH, _P_LEAF) or flags & ~(_P_BRANCH | _P_LEAF | 0x10):
            raise self.fail(f"page {pgno} has flags {flags:#x}")
        if not (_HEADER <= lower <= upper <= self.psize) or (lower - _HEADER) % 2:
            raise self.fail(f"page {pgno} has bounds {lower}..{upper}")
        children = []
        for k in range((lower - _HEADER) // 2):
            (at,) = struct.unpack_from("<H", page, _HEADER + 2 * k)
            if not upper <= at <= self.psize - _NODE.size:
                raise self.fail(f"page {pgno} node {k} at offset {at}")
            lo, hi, node_flags, ksize = _NODE.unpack_from(page, at)
            data_at = at + _NODE.size + ksize
            if kind == _P_BRANCH:
                if data_at > self.psize:
                    raise self.fail(f"page {pgno} node {k} key runs past the page")
                children.append(self.page_number(lo | hi << 16 | node_flags << 32, f"page {pgno} node {k}"))
            else:
                self.leaf_node(pgno, k, page, data_at, lo | hi << 16, node_flags)
        return children

    def leaf_node(self, pgno: int, k: int, page: bytes, data_at: int, size: int, flags: int) -> None:
        if flags & ~_F_BIGDATA:
            raise self.fail(f"page {pgno} node {k} has flags {flags:#x}")
        if not flags & _F_BIGDATA:
            if data_at + size > self.psize:
                raise self.fail(f"page {pgno} node {k} value runs past the page")
            return
        if data_at + 8 > self.psize:
            raise self.fail(f"page {pgno} node {k} overflow pointer runs past the page")
        (first,) = struct.unpack_from("<Q", page, data_at)
        self.page_number(first, f"page {pgno} node {k}")
        head = self.read(first, _HEADER)
        over_flags = _PAGE.unpack_from(head)[2]
        (pages,) = _OVERFLOW_PAGES.unpack_from(head, 12)
        if not over_flags & _P_OVERFLOW or pages * self.psize < _HEADER + size or first + pages - 1 > self.last:
            raise self.fail(f"overflow page {first} ({pages} pages) cannot hold {size} bytes")
        self.overflow.append((first, pages))


def check_lmdb_file(path: str, name: str) -> None:
    """Check the structure of the LMDB file at ``path`` before LMDB opens it.

    Raises:
        CorruptShardError: Naming ``name``, if anything LMDB would follow is out of bounds.
    """
    fd = open_regular_file(path, name)
    try:
        walk = _Walk(fd, name, os.fstat(fd).st_size)
        root, db_flags = walk.meta()
        if db_flags:
            raise walk.fail(f"main database flags {db_flags:#x} (streamload writes none)")
        if root != _P_INVALID:
            walk.walk(root)
    finally:
        os.close(fd)
