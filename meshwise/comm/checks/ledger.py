"""The collective ledger: what each rank asked of each channel (a group's collectives, or
one direction's transfers), in order, with NCCL's signature (counts and dtypes) and the
call site. A count and a running CRC-32 per channel tell whether ranks agree; the kept
entries say where they part (pure bookkeeping; docs/gpus.md).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

_COMM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshwise/comm
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(_COMM_DIR))
# The modules that issue and record operations: never a call site themselves.
_ISSUING = {
    os.path.join(_COMM_DIR, f"{name}.py")
    for name in (
        "ops",
        "groups",
        "point_to_point",
        "handle",
        "checks/context",
        "checks/ledger",
        "checks/strict",
    )
}
SLOT_BYTES = 320  # one entry in the file: a JSON line, space-padded
CAPACITY = 256
# Entries kept between two checks at most: many steps of the busiest layouts.
UNCHECKED_CAPACITY = 1 << 15


def call_site() -> str:
    """Who asked for an operation: ``file.py:123 in function`` of the innermost frame
    outside the modules that issue it, and when that frame is itself inside
    ``meshwise/comm`` (an algorithm, a compressor), the first frame outside it too."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _ISSUING:
        frame = frame.f_back
    if frame is None:
        return "?"
    site = _where(frame)
    if frame.f_code.co_filename.startswith(_COMM_DIR):
        outer = frame.f_back
        while outer is not None and outer.f_code.co_filename.startswith(_COMM_DIR):
            outer = outer.f_back
        if outer is not None:
            site += f", from {_where(outer)}"
    return site


def _where(frame) -> str:
    path = frame.f_code.co_filename
    if path.startswith(_PACKAGE_ROOT):
        path = os.path.relpath(path, _PACKAGE_ROOT)
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def signature(op: str, tensors) -> str:
    """What the other ends must match: the operation, each tensor's elements and dtype."""
    parts = [f"{str(t.dtype).removeprefix('torch.')}[{t.numel()}]" for t in tensors]
    return f"{op} {' '.join(parts)}".rstrip()


@dataclass
class Entry:
    """One operation as this rank issued it."""

    number: int  # this rank's running count of operations, all channels together
    channel: str
    seq: int  # the operation's number in its channel, from 1
    op: str
    signature: str
    site: str
    issued_s: float  # time.monotonic() when issued
    works: list = field(default_factory=list, repr=False)  # while it may be in flight
    done: bool = False

    def completed(self) -> bool:
        """Whether it has finished, asking the backend while it may be in flight."""
        if not self.done and self.works and all(w.is_completed() for w in self.works):
            self.done, self.works = True, []
        return self.done

    def to_dict(self) -> dict:
        return {
            "number": self.number,
            "channel": self.channel,
            "seq": self.seq,
            "op": self.op,
            "signature": self.signature,
            "site": self.site,
            "done": self.completed(),
            "age_s": round(time.monotonic() - self.issued_s, 3),
        }


class Ledger:
    """One rank's ledger: the last ``capacity`` entries and every channel's summary."""

    def __init__(self, rank: int, capacity: int = CAPACITY, path: str | os.PathLike | None = None):
        self.rank = rank
        self.entries: deque[Entry] = deque(maxlen=capacity)
        self.channels: dict[str, list[int]] = {}  # channel -> [count, crc]
        self.last: dict[str, Entry] = {}  # channel -> its latest entry
        self.unchecked: deque[Entry] | None = None  # since ranks last agreed, if they compare
        self._number = 0
        self._ring = _RingFile(path, capacity) if path else None

    def issue(self, channel: str, op: str, sig: str, site: str, works=None) -> Entry:
        count_crc = self.channels.setdefault(channel, [0, 0])
        count_crc[0] += 1
        count_crc[1] = zlib.crc32(sig.encode(), count_crc[1])
        self._number += 1
        entry = Entry(
            self._number, channel, count_crc[0], op, sig, site, time.monotonic(), list(works or [])
        )
        self.entries.append(entry)
        self.last[channel] = entry
        if self.unchecked is not None:
            self.unchecked.append(entry)
        if self._ring is not None:
            self._ring.write(entry)
        return entry

    def complete(self, entry: Entry) -> None:
        entry.done, entry.works = True, []
        if self._ring is not None:
            self._ring.write(entry)

    def oldest_pending(self) -> Entry | None:
        """The earliest entry still in flight (asks the backend), or None."""
        # A copy: other threads append while the backend is asked (it releases the GIL).
        return next((e for e in tuple(self.entries) if not e.completed()), None)

    def keep_unchecked(self, capacity: int = UNCHECKED_CAPACITY) -> None:
        """From now on keep every entry until ``checked`` (ranks compare ledgers)."""
        if self.unchecked is None:
            self.unchecked = deque(maxlen=capacity)

    def checked(self) -> None:
        """Every rank agreed with this one on everything issued so far."""
        if self.unchecked is not None:
            self.unchecked.clear()

    def summary(self) -> dict[str, list[int]]:
        """Channel -> [count, crc]: equal between ranks that agree."""
        return {channel: list(value) for channel, value in self.channels.items()}

    def dump(self, unchecked: bool = False) -> dict:
        """Everything a diagnosis needs: this rank's summary and recent entries; with
        ``unchecked``, also every entry since ranks last agreed and each channel's last
        (where a peer stopped), oldest first."""
        entries = tuple(self.entries)
        if unchecked and self.unchecked is not None:
            by_number = {e.number: e for e in (*self.unchecked, *entries, *self.last.values())}
            entries = tuple(by_number[n] for n in sorted(by_number))
        return {
            "rank": self.rank,
            "channels": self.summary(),
            "entries": [e.to_dict() for e in entries],
        }

    def write_json(self, directory: str | os.PathLike) -> Path:
        """Write ``dump()`` as ``ledger-rank<r>.json`` under ``directory``."""
        path = Path(directory) / f"ledger-rank{self.rank:05d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.dump(), indent=1) + "\n")
        return path


class _RingFile:
    """The ledger's entries in a file of fixed slots, written as they change."""

    def __init__(self, path, capacity: int):
        self.capacity = capacity
        with open(path, "wb") as f:
            f.truncate(capacity * SLOT_BYTES)
        self._file = open(path, "r+b")  # noqa: SIM115 - held for the process's life
        self._map = mmap.mmap(self._file.fileno(), capacity * SLOT_BYTES)

    def write(self, entry: Entry) -> None:
        line = json.dumps(
            {
                "number": entry.number,
                "channel": entry.channel[:60],
                "seq": entry.seq,
                "op": entry.op,
                "signature": entry.signature[:80],
                "site": entry.site[-120:],
                "done": entry.done,
                "issued_s": round(entry.issued_s, 3),
            }
        )
        data = line.encode()[: SLOT_BYTES - 1].ljust(SLOT_BYTES - 1) + b"\n"
        start = (entry.number - 1) % self.capacity * SLOT_BYTES
        self._map[start : start + SLOT_BYTES] = data


def read_ring(path: str | os.PathLike) -> list[dict]:
    """The entries of a ledger file, oldest first, with their age now (for a
    launcher on the same machine, after the rank died)."""
    entries, now = [], time.monotonic()
    for line in Path(path).read_bytes().split(b"\n"):
        line = line.strip()
        if line:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a slot being written when the rank died
                continue
            entry["age_s"] = round(now - entry.pop("issued_s"), 3)
            entries.append(entry)
    return sorted(entries, key=lambda e: e["number"])


def read_ledgers(folder: str | os.PathLike) -> dict[int, dict]:
    """Every rank's ring file in ``folder`` (``rank-<r>.ledger``) as a dump: rank -> entries."""
    dumps = {}
    for path in sorted(Path(folder).glob("rank-*.ledger")):
        rank = int(path.stem.split("-")[1])
        dumps[rank] = {"rank": rank, "entries": read_ring(path)}
    return dumps


def write_dumps(dumps: dict[int, dict], directory: str | os.PathLike) -> Path:
    """Write each rank's dump as ``ledger-rank<r>.json`` under ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps.items():
        (directory / f"ledger-rank{rank:05d}.json").write_text(json.dumps(dump, indent=1) + "\n")
    return directory
