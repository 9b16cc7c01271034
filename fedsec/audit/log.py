"""Reading a transparency-log file: every line parsed and chained to the one before.

The format itself (entries, heads, canonical lines) is :mod:`fedsec.protocol.log`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fedsec.errors import IntegrityError
from fedsec.protocol.log import GENESIS_PREV, LogEntry, parse_line


def read_log(path: Path) -> Iterator[LogEntry]:
    """Entries of a log file, each parsed and chained to the previous one.

    Raises:
        IntegrityError: the first line that is malformed, out of order or unchained.
    """
    prev = GENESIS_PREV
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                raise IntegrityError(f"{path} line {lineno}: truncated (no newline at the end)")
            entry = parse_line(raw[:-1], lineno, str(path))
            if entry.index != lineno - 1:
                raise IntegrityError(
                    f"{path} line {lineno}: entry index {entry.index}, expected {lineno - 1} "
                    "(an entry was deleted, inserted or reordered)"
                )
            if entry.prev != prev:
                raise IntegrityError(
                    f"{path} line {lineno}: entry {entry.index} does not chain to the entry "
                    "before it (an earlier entry was altered, deleted or reordered)"
                )
            prev = entry.hash
            yield entry
