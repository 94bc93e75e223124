"""Shared memory between the weight sender and the rollout engines on its machine.

Owns: ``SharedSegment``, a file in ``/dev/shm`` mapped into every process that opens it
(``MAP_SHARED``: one set of pages, whatever the number of readers): a 64-byte header (a
random token, so an opener knows it mapped the sender's file and not a stale one, and a
sequence number, which says which write the bytes are and whether one is under way)
followed by the data. The sender writes a version's buckets into it once; every local
engine reads them in place. A tiny segment with no data is the probe by which an engine
finds out, at joining, that it shares the sender's ``/dev/shm`` (same machine, same
container): it can open the file and read the token.

The file is reserved whole when it is made (``posix_fallocate``), so a ``/dev/shm`` too
small for it fails there, with an ``OSError`` the caller can fall back on, instead of a
SIGBUS at the first write into a page that has no room. The sender removes the name once
every reader has mapped it (the pages live on while mapped), so a crash leaves nothing
behind after that point. A process killed before it (SIGKILL: the out-of-memory killer,
``ray.kill``) leaves a file as large as the model until reboot, so the sender sweeps at
start (``remove_orphans``): a segment's name carries its maker's pid, and its maker holds
a lock on it while the name exists, so a file whose maker is gone and whose lock is free
is nobody's.

Knows nothing about buckets, groups or vLLM.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import uuid
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ROOT = Path("/dev/shm")
PREFIX = "async-rl-weights-"
"""Every segment's name: this, its maker's pid, ``-``, a random hex id."""
_NAME = re.compile(rf"{re.escape(PREFIX)}(\d+)-[0-9a-f]+")
HEADER = 64
"""Bytes before the data: the token (16), the sequence number (8), padding to a cache line."""
_TOKEN = slice(0, 16)
_SEQ = slice(16, 24)
WRITING = 0
"""The sequence number while a write is under way (a finished write's is positive)."""


class SharedSegment:
    """One shared file, mapped; ``data`` is its payload as a flat ``uint8`` tensor."""

    def __init__(self, path: Path, token: bytes, mapped: torch.Tensor,
                 lock: int | None = None) -> None:
        self.path, self.token = path, token
        self._lock = lock
        """The maker's descriptor of the file, locked until ``unlink``: a sweep from
        another process leaves a locked segment alone (None: opened, not made, here)."""
        self._mapped = mapped
        self.data = mapped[HEADER:]
        self._seq = mapped[_SEQ].view(torch.int64)
        self._writes = 0

    @classmethod
    def create(cls, nbytes: int) -> SharedSegment:
        """A new segment of ``nbytes`` of data (0: a probe), its memory reserved now.
        Raises OSError when ``/dev/shm`` has no room (or does not exist)."""
        path = ROOT / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # released when this process ends, however
            os.posix_fallocate(fd, 0, HEADER + nbytes)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        mapped = torch.from_file(str(path), shared=True, size=HEADER + nbytes,
                                 dtype=torch.uint8)
        token = secrets.token_bytes(16)
        mapped[_TOKEN].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        segment = cls(path, token, mapped, lock=fd)
        segment.seq = WRITING
        return segment

    @classmethod
    def open(cls, path: str, nbytes: int, token: str) -> SharedSegment | None:
        """The sender's segment, mapped here; None when this process cannot see it (another
        machine, another ``/dev/shm``) or the file there is not the sender's."""
        file = Path(path)
        try:
            if file.stat().st_size != HEADER + nbytes:
                return None
            mapped = torch.from_file(path, shared=True, size=HEADER + nbytes,
                                     dtype=torch.uint8)
        except (OSError, RuntimeError):
            return None
        if bytes(mapped[_TOKEN].tolist()) != bytes.fromhex(token):
            return None
        return cls(file, bytes.fromhex(token), mapped)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def seq(self) -> int:
        return int(self._seq.item())

    @seq.setter
    def seq(self, value: int) -> None:
        # An aligned 8-byte store: readers see the old or the new number, never a mix.
        self._seq.fill_(value)

    def begin_write(self) -> int:
        """Marks a write under way; returns the number to set ``seq`` to once it is done
        (this segment's writes, counted from 1)."""
        self._writes += 1
        self.seq = WRITING
        return self._writes

    def unlink(self) -> None:
        """Removes the name (readers that mapped it keep their pages)."""
        self.path.unlink(missing_ok=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def remove_orphans(root: Path | None = None) -> tuple[int, int]:
    """Removes the segments in ``root`` (``ROOT``) left by processes that are gone:
    their maker's pid is not alive and nobody holds their lock. Returns (segments,
    bytes) removed, and says so in one log line when there were any. A pid reused by
    another process keeps its file (left for a later sweep), never the reverse."""
    root = ROOT if root is None else root
    removed = freed = 0
    try:
        names = os.listdir(root)
    except OSError:  # no /dev/shm here
        return 0, 0
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = root / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live maker we cannot see (another pid namespace)
            os.close(fd)
            continue
        try:
            size = os.fstat(fd).st_size
            path.unlink()
        except OSError:
            continue
        finally:
            os.close(fd)
        removed, freed = removed + 1, freed + size
    if removed:
        log.info("weights: removed %d shared-memory segment(s) left by processes that are "
                 "gone (%d bytes) from %s", removed, freed, root)
    return removed, freed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
