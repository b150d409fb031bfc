"""The local shard cache: bounded, least-recently-used, shared by every process on a node.

Every DataLoader worker of every rank on a machine opens the same cache directory; they
coordinate with ``flock(2)`` locks on files and atomic renames only. Nothing lives in
named shared memory, and every lock dies with the process holding it, so a crash
(even SIGKILL) leaves nothing behind that blocks the others.

Layout, one directory per dataset (``<cache_dir>/<hash of the dataset URL>/``); who locks
what, and which module of this package keeps it::

    .lock                 exclusive flock while a process counts bytes, reserves room,
                          evicts, or renames a download into data/ (layout)
    data/<name>           complete, verified files; mtime = last use (the LRU clock); no
                          lock of their own: their pins guard them (copies)
    pins/<name>           shared flock = "in use"; exclusive flock (never waited for) =
                          "being evicted" (room)
    downloads/<name>      exclusive flock = "being downloaded" (one downloader per file,
                          for the whole download; discarding a corrupt copy takes it too)
                          (intake)
    tmp/<name>.<size>.<pid>.<random>.part
                          a download in progress, exclusively flocked by its writer;
                          its name carries the bytes it reserves against the limit; an
                          unlocked one is a dead writer's, deleted by the next count (room)
    meta/<name>           "<hash or -> <size> <inode> <generation>" of the verified
                          download now in data/<name> (written under .lock just before
                          the rename; the generation is a random token of that download)
    meta/.<name>.<pid>.<random>.tmp
                          a record being written, renamed over meta/<name> (copies)
    readers/<pid>.<random>
                          one per process reading through the cache, exclusively
                          flocked while it reads (see "Admission" below); made as
                          readers/.<pid>.<random>, locked, then renamed (readers)
    landing/<name>        JSON ``{"part", "attempt", "landed"}``: the part file in tmp/
                          and the byte ranges of it already written, replaced atomically
                          (from landing/.<name>.<pid>.<random>.tmp) by the process
                          holding downloads/<name> as its bytes land, deleted when the
                          download ends (a crashed downloader's stays until the next
                          download of the file replaces it). No lock of its own: only
                          processes waiting on downloads/<name> read it, and serve those
                          ranges from the part file early (landing)

Every descriptor the cache opens is opened and closed in :mod:`.flocks`, which also
waits for locks (bounded) and names their holders. A forked child closes its copies at
once (a lock taken by the parent is never held by a child), and a pin or registration it
inherited closes nothing of the child's when it is closed there.

Names are checked to be plain file names (see
:func:`~streamload._files.check_file_name`), so no path built here leaves the cache. No
bookkeeping name can be a shard's: each kind of lock has a folder of its own (a shard named
``s.tar.dl`` and one named ``s.tar`` once shared ``pins/s.tar.dl``, and reading the second
while the first was open waited for ever on its own lock), and the cache's own temporary
names start with a dot, which no plain name does. Every lock wait is bounded
(``lock_timeout``) and ends in a :class:`~streamload.CacheError` naming the lock file and
the process holding it; a wait of more than a few seconds (:data:`LOCK_NOTICE`) is logged
once, naming them too (a warning when the holder is a stopped process).

Links. A cache directory may sit where others can write (a node-wide ``STREAMLOAD_CACHE``),
so the cache never follows a link it did not make: its folders must be real directories
(checked with ``lstat`` whenever one is listed), every file is opened with
``O_NOFOLLOW``, a cached file is served only if it is a regular file, and sizes are counted
without following links. Deleting a link deletes the link, never its target. The dataset's
cache folder must belong to the user and not be writable by group or others (a
:class:`~streamload.CacheError` says so), unless ``STREAMLOAD_CACHE_SHARED=1`` allows a
folder shared by a group of users (then a link planted there is refused, never followed).

A full disk. A download that meets ``ENOSPC`` (or a quota) ends in a
:class:`~streamload.CacheError` naming the cache directory and the bytes it needed: it is
not the shard's fault, so it is never a corrupt shard and never a skipped sample.

Invariants:

* The bytes in ``data/`` plus the bytes reserved by ``tmp/`` never exceed ``limit``:
  room is made, and a download reserved, under ``.lock``.
* A file with a shared lock on its pin is never deleted: eviction takes the pin's lock
  exclusively *without waiting* and skips the file if that fails.
* ``data/<name>`` only ever appears complete and verified (size, and hash when known):
  it is renamed into place from ``tmp/``. A partial file whose writer died is unlocked;
  the next process that makes room deletes it.
* A cached file is served only for the manifest entry it was verified against: the
  directory is keyed by URL, and a dataset re-written at the same URL may have files of
  the same names *and sizes* (tar shards are multiples of 512 bytes) but other bytes.
  :meth:`ShardCache.lookup` compares the entry's hash with ``meta/<name>`` (and the
  record's inode with the file's, so a record left by a crash between writing it and the
  rename never vouches for an older file); a mismatch is a miss, and the download
  replaces the stale file (which is deleted first, so it holds no room the download needs).

Corrupt copies. A copy can go bad on local disk after it was verified (a flipped bit, a
restore from a bad backup); its size and record still match, so :meth:`ShardCache.lookup`
serves it, and the format reader's per-sample checksum finds it. The reader's storage then
calls :meth:`ShardCache.discard`: if ``data/<name>`` is still the copy it read (the same
download generation: not an inode, which a fresh file may reuse) and does not hash to its
entry (or the entry has no hash to tell), the copy is deleted (its name only: processes
reading it keep their descriptors), so the next acquire downloads it again. A copy that
does hash to its entry is kept: the shard is bad at its source, and a download would
bring the same bytes. Deleting skips the pin's exclusive lock (a reader may keep a bad
copy open for long); a process that looked the file up just before then meets a missing
file when it opens it, and looks it up again (see ``streamload.shards``).

Admission. Every reader needs room for the shard it reads, pinned, and a DataLoader hands
out samples in order, so a reader waiting for room held by the others' pins can wait for
ever: the others stop when their queues are full, and keep their pins. So each process
that reads registers in ``readers/`` (:meth:`ShardCache.register`, an exclusive flock held
while it reads: a crash unregisters it) and counts the live registrations
(:meth:`ShardCache.readers`). :class:`~streamload.storage.remote.RemoteStorage` refuses at
once a reader that would make the readers' shards outgrow the limit, and shares the limit
among the registered readers when it tells each how many shards it may keep open. A wait
for room that does happen (another process's download holds it) logs a line every
``log_every`` seconds until it ends or ``wait_timeout`` runs out.
"""

from __future__ import annotations

from .flocks import LOCK_NOTICE, lock_holders
from .readers import Registration
from .room import Pin
from .settings import DEFAULT_LOCK_TIMEOUT, DEFAULT_LOG_EVERY, DEFAULT_WAIT_TIMEOUT, SHARED_ENV
from .shardcache import ShardCache
from .stats import CacheStats

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_LOG_EVERY",
    "DEFAULT_WAIT_TIMEOUT",
    "LOCK_NOTICE",
    "SHARED_ENV",
    "CacheStats",
    "Pin",
    "Registration",
    "ShardCache",
    "lock_holders",
]
