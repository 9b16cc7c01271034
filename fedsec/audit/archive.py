"""Content-addressed archive of accepted protocol messages (masked inputs, reveals, ...).

A file's name is the SHA-256 of its bytes, so anyone holding the archive and the
transparency log can re-run every aggregation and detect a swapped file.  Masked
inputs reveal nothing on their own; unmask reveals only what the aggregator was
entitled to learn.  Writes are atomic (temp file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fedsec.errors import IntegrityError, NotFound


class Archive:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise IntegrityError(f"archive reference {digest!r} is not a sha256 hex digest")
        return self.root / digest[:2] / digest

    def put(self, data: bytes) -> str:
        """Store ``data``; return its sha256 hex.  Idempotent."""
        digest = hashlib.sha256(data).hexdigest()
        target = self.path(digest)
        if target.exists():
            return digest
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{digest}.tmp-{os.getpid()}")
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        return digest

    def get(self, digest: str) -> bytes:
        """The archived bytes for ``digest``, checked against it.

        Raises:
            NotFound: not in the archive (e.g. past retention).
            IntegrityError: the file's content does not match its name (swapped).
        """
        target = self.path(digest)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"archive has no object {digest}") from None
        actual = hashlib.sha256(data).hexdigest()
        if not hmac.compare_digest(actual, digest):
            raise IntegrityError(f"archive object {digest} holds content with sha256 {actual}")
        return data
