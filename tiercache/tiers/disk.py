"""The local-disk tier: one file per chunk, an in-memory LRU index rebuilt from the files at start.

Files are named `<key digest>-<sequence>.chunk` in 256 fan-out folders. The sequence number makes every write a new
file, so an eviction that unlinks the old file can never remove a newer copy written concurrently under the same key.
Writes go to a temporary file that is renamed into place (atomic on POSIX), optionally after fsync, so a crash leaves
either the old state or the new record, never a torn one; leftovers of interrupted writes are removed at start.
With `disk.fsync` the file and its folder are fsynced before the put returns: a put acknowledged as stored in the
disk tier then survives a crash or power loss (a put acknowledged in a memory tier never does).

The byte cap counts record bytes (what `stats` shows), and space is reserved before a write starts, so concurrent
writers together never exceed it. File I/O runs outside the metadata lock.

Evicted files are unlinked by a background thread. With a million files, a create and an unlink interleaved on one
thread ran at 7.0K pairs/s against 18.3K creates/s alone (ext4, this machine); with the unlinks on a second thread
the creates kept their rate and the unlinks kept up (`benchmarks/eviction.py`). A file counts against the cap until
it is unlinked, so eviction frees a little ahead — down to the cap less a headroom of 1/1000 of it (at most 64 MiB,
and only for records of at most a quarter of that) — and puts do not wait for the unlinker while it keeps up; when
it does not, a put waits for room rather than exceed the cap. Explicit deletes and replaced records are unlinked
before the call returns.

A victim on its way to the tier below (Redis) stays readable here until the store has placed it there and released its
room (tiercache.tiers.indexed): a chunk moving down is in one tier or the other at every moment, as it is out of the
host arena.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tiercache.config import DiskTierConfig, state_budget
from tiercache.errors import ChunkCorrupt, ConfigError, TierDown, TierWriteFailed
from tiercache.record import encoding
from tiercache.record.codec import codec_id
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import Room
from tiercache.tiers.directory_lock import DirectoryLock
from tiercache.tiers.index import ChunkIndex, Victim
from tiercache.tiers.indexed import IndexedTier

log = logging.getLogger(__name__)

_SUFFIX = ".chunk"
_MAX_HEADROOM_BYTES = 64 << 20
_ROOM_WAIT_S = 1.0  # a put waiting for the unlinker re-checks at least this often
_TEMP_SUFFIX = ".tmp"
_HEADER_PROBE_BYTES = 4096  # covers the largest header without tokens (fixed part + 256-char namespace + 64-byte keys)


@dataclass(slots=True, frozen=True)
class _File:
    """A record held on disk (the index's entry): its file."""

    path: str
    record_bytes: int
    sequence: int
    meta: encoding.ChunkMeta


class DiskTier(IndexedTier[_File]):
    name = "disk"
    checksum_on_read = True
    shared_by_nodes = False

    def __init__(self, config: DiskTierConfig) -> None:
        super().__init__(ChunkIndex(config.state_value_weight), config.capacity_bytes,
                         state_budget(config.capacity_bytes, config.state_budget_bytes))
        self.root = Path(config.path).expanduser()
        self.codec = codec_id(config.codec)
        self._fsync = config.fsync
        self._reserved_bytes = 0
        self._releasing_bytes = 0
        self._headroom = min(config.capacity_bytes // 1000, _MAX_HEADROOM_BYTES)
        self._room = threading.Condition(self._lock)  # notified as the unlinker frees bytes
        self._prepare_root()
        self._sequence = itertools.count(self._rebuild_index() + 1)
        self._unlinks: queue.SimpleQueue[_File | None] = queue.SimpleQueue()
        self._unlinker = threading.Thread(target=self._unlink_loop, name="tiercache-disk-unlink", daemon=True)
        self._unlinker.start()

    # -- contract ---------------------------------------------------------------------------------------------------

    def put(self, room: Room, record) -> None:
        sequence = next(self._sequence)
        entry = _File(self._path_for(room.key, sequence), room.size, sequence, room.meta)
        try:
            self._write_file(entry.path, record)
        except OSError as exc:  # e.g. ENOSPC: the filesystem is fuller than our cap says (other writers share it)
            self.release(room)
            raise TierWriteFailed(f"disk tier write failed: {exc.strerror or exc}") from None
        with self._lock:
            self._unclaim(room.claim, room.size, room.state_bytes)
            room.claim = None
            replaced = self._take_out([room.key])  # a concurrent put of the same key: last one wins
            self._index.add(room.key, entry)
        self._discard(replaced)

    def get(self, key: ChunkKey) -> bytearray | None:
        with self._lock:
            entry = self._found(key)
        if entry is None:
            return None
        try:
            with open(entry.path, "rb", buffering=0) as f:
                record = bytearray(entry.record_bytes)
                n = f.readinto(record)
        except FileNotFoundError:  # evicted or replaced between the lookup and the open
            return None
        except OSError as exc:  # EIO and the like: the store counts a miss and an error of the tier
            raise TierDown(f"disk tier read failed: {exc.strerror or exc}") from None
        return record if n == entry.record_bytes else record[:n]  # short: decode reports it corrupt

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            removed = self._take_out(keys)
        self._discard(removed)
        return len(removed)

    def close(self) -> None:
        """Every file is complete on disk once put returns; evicted ones are unlinked before close returns. The
        directory is free for another server after."""
        if self._unlinker.is_alive():
            self._unlinks.put(None)
            self._unlinker.join()
        self._directory_lock.release()

    # -- the room (IndexedTier's hooks) -----------------------------------------------------------------------------

    # Space accounting. A file counts against the cap from the moment its room is claimed until it is unlinked:
    # `used` (indexed files) + `reserved` (rooms claimed, writes in flight) + `releasing` (files taken out of the index
    # but not yet unlinked: victims leaving, files queued for the unlinker) never exceeds capacity_bytes, so the files
    # on disk never do either.

    def _claim(self, size: int, state: int) -> int | None:
        if (self._index.used_bytes + self._reserved_bytes + self._releasing_bytes + size > self.capacity_bytes
                or self._index.state_excess(state, self.state_budget_bytes) > 0):
            return None
        self._reserved_bytes += size
        self._index.state_reserved += state
        return size

    def _shortfall(self, size: int) -> int:
        """What to evict for `size` bytes to fit within the cap less the headroom, counting what is already on its
        way out as gone (so puts do not wait for the unlinker while it keeps up)."""
        headroom = self._headroom if self._headroom >= 4 * size else 0  # small records only: big ones go one by one
        return self._index.used_bytes + self._reserved_bytes + size - (self.capacity_bytes - headroom)

    def _hold(self, entry: _File) -> None:
        self._releasing_bytes += entry.record_bytes

    def _let_go(self, entry: _File) -> None:
        self._unlinks.put(entry)  # its bytes count until the unlinker has removed the file

    def _unclaim(self, claim: int, size: int, state: int) -> None:
        self._reserved_bytes -= size
        self._index.state_reserved -= state

    def _wait_for_room(self) -> bool:
        if not self._releasing_bytes:  # the rest of the room is claimed by writes in flight
            return False
        self._room.wait(_ROOM_WAIT_S)  # room is on its way out: wait for the unlinker
        return True

    def _drop(self, key: ChunkKey) -> None:
        with self._lock:
            stale = self._take_out([key])
        self._discard(stale)

    def _read_entry(self, entry: _File) -> bytes | None:
        return self._read_file(entry.path)

    # -- files ------------------------------------------------------------------------------------------------------

    def _take_out(self, keys: Sequence[ChunkKey]) -> list[Victim[_File]]:
        """Under the lock: remove keys from the index; their bytes stay counted (releasing) until _discard."""
        taken = [Victim(k, e, True) for k, e in ((k, self._index.remove(k)) for k in keys) if e is not None]
        self._releasing_bytes += sum(v.entry.record_bytes for v in taken)
        return taken

    def _discard(self, victims: list[Victim[_File]]) -> None:
        """Outside the lock: unlink taken-out files now and stop counting their bytes."""
        for victim in victims:
            self._release(victim.entry)

    def _release(self, entry: _File) -> None:
        _unlink(entry.path)
        with self._lock:
            self._releasing_bytes -= entry.record_bytes
            self._room.notify_all()

    def _unlink_loop(self) -> None:
        while (entry := self._unlinks.get()) is not None:
            try:
                self._release(entry)
            except OSError as exc:  # EIO and the like: the bytes are counted as freed; the file is left behind
                log.warning("disk tier could not remove %s: %s", entry.path, exc)
                with self._lock:
                    self._releasing_bytes -= entry.record_bytes
                    self._room.notify_all()

    def _path_for(self, key: ChunkKey, sequence: int) -> str:
        digest = key.digest
        return str(self.root / digest[:2] / f"{digest}-{sequence:x}{_SUFFIX}")

    def _write_file(self, path: str, record) -> None:
        temp = path + _TEMP_SUFFIX
        folder = os.path.dirname(path)
        created = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        try:
            with open(temp, "wb", buffering=0) as f:
                f.write(record)
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            _unlink(temp)
            raise
        if self._fsync:  # the rename (and a new fan-out folder) must reach the disk too, or the file may vanish
            _fsync_dir(folder)
            if created:
                _fsync_dir(str(self.root))

    @staticmethod
    def _read_file(path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    # -- start-up ---------------------------------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        """Create the directory, take its lock (before the index rebuild, which deletes files), check it is
        writable."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._directory_lock = DirectoryLock(self.root)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except (FileExistsError, NotADirectoryError):  # "File exists" did not say that the path names a file
            raise ConfigError(_not_a_directory(self.root)) from None
        except OSError as exc:
            raise ConfigError(f"disk tier directory {self.root} is not usable: {exc.strerror or exc}") from None

    def _rebuild_index(self) -> int:
        """Index every complete record file, oldest first; drop temp files, damaged headers and stale duplicates.

        Returns the highest sequence number seen, so new files never reuse a name.
        """
        found: dict[ChunkKey, _File] = {}
        mtimes: dict[ChunkKey, float] = {}
        top_sequence = 0
        for path in self.root.glob("*/*"):
            name = path.name
            if name.endswith(_TEMP_SUFFIX) or not name.endswith(_SUFFIX):
                _unlink(str(path))  # an interrupted write, or nothing of ours
                continue
            try:
                sequence = int(name[:-len(_SUFFIX)].rsplit("-", 1)[1], 16)
                stat = path.stat()
                with open(path, "rb") as f:
                    probe = f.read(_HEADER_PROBE_BYTES)
                    size = encoding.header_size(probe)
                    if size > len(probe):  # a header with an engine block (tokens) can outgrow the probe
                        probe += f.read(size - len(probe))
                    header = encoding.read_header(probe)
            except (ValueError, IndexError, OSError, ChunkCorrupt):
                _unlink(str(path))
                continue
            if header.record_bytes != stat.st_size:  # truncated or padded: never serve it
                _unlink(str(path))
                continue
            top_sequence = max(top_sequence, sequence)
            entry = _File(str(path), stat.st_size, sequence, header.meta)
            older = found.get(header.key)
            if older is not None:
                loser = older if older.sequence < sequence else entry
                _unlink(loser.path)
                if loser is older:
                    found[header.key], mtimes[header.key] = entry, stat.st_mtime
                continue
            found[header.key], mtimes[header.key] = entry, stat.st_mtime
        for key in sorted(found, key=lambda k: (mtimes[k], found[k].sequence)):
            self._index.add(key, found[key])
        # The caps may have shrunk since the last run.
        for victim in self._index.victims(self._index.used_bytes - self.capacity_bytes,
                                          self._index.state_bytes - self.state_budget_bytes):
            _unlink(victim.entry.path)
        return top_sequence

    def check(self) -> None:
        with self._lock:
            self._index.check()
            assert self._index.used_bytes <= self.capacity_bytes
            assert self._index.state_bytes <= self.state_budget_bytes
            for _, entry in self._index.items():
                assert os.path.getsize(entry.path) == entry.record_bytes, entry.path


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _not_a_directory(path: Path) -> str:
    """What made mkdir fail, in one line: the path, or the first of its parents, is a file (or a link to nothing)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate) and not candidate.is_dir():
            what = "a file" if candidate.exists() else "a broken symbolic link"
            where = path if candidate == path else f"{path}: {candidate}"
            return f"disk tier directory {where} is {what}, not a directory (--disk-dir, disk.path)"
    return f"disk tier directory {path} is not a directory (--disk-dir, disk.path)"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
