"""What each rank says about its collectives: small records, their wire form, and the pure
comparisons the watchdog makes between ranks (no process group, no threads here)."""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType

#: The nn_handler package's folder (this file is nn_handler/distributed/faults/watchdog/).
_PACKAGE = os.path.abspath(__file__).rsplit(f"{os.sep}distributed{os.sep}faults{os.sep}", 1)[0]
_TORCH_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}contextlib.py", f"{os.sep}threading.py")

#: Characters of a signature kept in a record (the digest covers the whole text).
SIGNATURE_CHARS = 160


@dataclass(frozen=True)
class Record:
    """One collective this rank issued: its number in the group (from 1), what it was (the
    operation with its structure, shapes and dtypes), a digest of that text, and the user's
    ``file:line`` that led to it."""

    seq: int
    what: str
    digest: int
    where: str


def make_record(seq: int, what: str, where: str) -> Record:
    return Record(seq, what[:SIGNATURE_CHARS], zlib.crc32(what.encode()), where)


#: Whether a file is the library's (nn_handler, torch, contextlib, threading), by file name.
_LIBRARY: dict[str, bool] = {}

#: Where a collective came from, as recorded on the training thread (formatted later).
Site = tuple[str, int, str]


def is_library(filename: str) -> bool:
    """Whether code in ``filename`` is nn_handler's or torch's (not the user's line)."""
    known = _LIBRARY.get(filename)
    if known is None:
        known = _LIBRARY[filename] = filename.startswith(_PACKAGE) or any(
            part in filename for part in _TORCH_PARTS
        )
    return known


def user_site(frame: FrameType | None = None) -> Site:
    """(file, line, function) of the innermost frame outside nn_handler and torch (the
    caller's own code); the innermost frame when every frame is the library's. Cheap: a few
    dictionary lookups per frame, for every collective."""
    current: FrameType | None = frame if frame is not None else sys._getframe(1)
    first = current
    while current is not None and is_library(current.f_code.co_filename):
        current = current.f_back
    chosen = current or first
    if chosen is None:
        return ("?", 0, "?")
    return (chosen.f_code.co_filename, chosen.f_lineno, chosen.f_code.co_name)


def format_site(site: Site) -> str:
    """``file:line in function``, the file relative to the working directory when inside."""
    filename, line, name = site
    return f"{_short(filename)}:{line} in {name}"


def user_location(frame: FrameType | None = None) -> str:
    """``file:line in function`` of ``user_site`` (the caller's own code)."""
    return format_site(user_site(frame if frame is not None else sys._getframe(1)))


def _short(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith("..") else relative


@dataclass
class RankState:
    """What one rank publishes: its latest collectives, whether it is inside the newest one,
    since when (seconds ago, at publication), whether it is working on purpose outside a
    collective (``busy``: inside ``Communicator.patient()``), and on request its main
    thread's stack."""

    rank: int
    seq: int
    inside: bool
    seconds: float
    records: list[Record] = field(default_factory=list)
    stack: str = ""
    where_now: str = ""
    busy: bool = False

    @property
    def latest(self) -> Record | None:
        return self.records[-1] if self.records else None

    def at(self, seq: int) -> Record | None:
        for record in reversed(self.records):
            if record.seq == seq:
                return record
        return None

    def to_bytes(self) -> bytes:
        data = asdict(self)
        data["records"] = [list(asdict(r).values()) for r in self.records]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> RankState:
        data = json.loads(payload.decode(errors="replace"))
        data["records"] = [Record(*row) for row in data["records"]]
        return cls(**data)


def find_mismatch(first: RankState, second: RankState) -> tuple[Record, Record] | None:
    """The earliest collective number both ranks have a record of where they issued different
    operations, structures, shapes or dtypes; None when all shared numbers agree."""
    theirs = {record.seq: record for record in second.records}
    for mine in first.records:
        other = theirs.get(mine.seq)
        if other is not None and other.digest != mine.digest:
            return mine, other
    return None


def neighbour(rank: int, world_size: int) -> int:
    """The rank whose records ``rank`` compares with its own: the next one, around the ring
    (a difference between any two ranks shows between some pair of neighbours)."""
    return (rank + 1) % world_size


def describe(record: Record | None) -> str:
    if record is None:
        return "no collective yet"
    return f"{record.what} #{record.seq} at {record.where}"


def ranks_text(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(map(str, ordered))


__all__ = [
    "SIGNATURE_CHARS",
    "RankState",
    "Record",
    "describe",
    "find_mismatch",
    "make_record",
    "neighbour",
    "ranks_text",
    "format_site",
    "is_library",
    "user_location",
    "user_site",
]
