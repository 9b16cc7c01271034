"""Key files: a signing identity's secret key (mode 0600) and public keys (hex text).

The I/O half of :mod:`fedsec.crypto.identity`, which only turns keys into bytes and
back.  A secret key file is written atomically (temp file, fsync, hard link) with mode
0600 whatever the umask, never over an existing key (the link refuses one atomically,
so of two concurrent writers one wins), and refused on reading when group or others
may access it: a key others could read must be treated as leaked, so fedsec names the
problem rather than "fixing" the mode silently.
"""

from __future__ import annotations

import stat
from pathlib import Path

from fedsec.crypto.identity import PUBLIC_KEY_BYTES, SigningIdentity
from fedsec.errors import KeyFileError
from fedsec.fsio import atomic_create

__all__ = ["load_identity", "load_public_key", "save_identity", "save_public_key"]

#: Missing parent directories of a key file are created with the umask's default mode:
#: the key file itself is 0600, and its directory may hold public keys as well.
_KEY_DIR_MODE = 0o777


def save_identity(identity: SigningIdentity, path: Path) -> None:
    """Write ``identity``'s secret key to ``path`` with mode 0600, atomically.

    Raises:
        KeyFileError: ``path`` already exists, or another writer created it first (a key
            is never overwritten: of two concurrent writers exactly one succeeds).
    """
    path = Path(path)
    try:
        atomic_create(path, identity.to_secret_bytes(), mode=0o600, parents_mode=_KEY_DIR_MODE)
    except FileExistsError:
        raise KeyFileError(f"{path} already exists; refusing to overwrite a key") from None


def load_identity(path: Path) -> SigningIdentity:
    """Read a key written by :func:`save_identity`.

    Raises:
        KeyFileError: missing, readable by group/others, or malformed.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"key file {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
        )
    try:
        return SigningIdentity.from_secret_bytes(path.read_bytes())
    except KeyFileError as exc:
        raise KeyFileError(f"key file {path} is malformed: {exc.detail}") from None


def save_public_key(path: Path, public_bytes: bytes) -> None:
    """Write a public key as hex text (the form handed to the consortium)."""
    Path(path).write_text(public_bytes.hex() + "\n")


def load_public_key(path: Path) -> bytes:
    """Read a public key written by :func:`save_public_key`.

    Raises:
        KeyFileError: missing or not 32 bytes of hex.
    """
    try:
        text = Path(path).read_text().strip()
        raw = bytes.fromhex(text)
    except FileNotFoundError:
        raise KeyFileError(f"public key file {path} does not exist") from None
    except ValueError:
        raise KeyFileError(f"public key file {path} is not hex") from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise KeyFileError(f"public key file {path} holds {len(raw)} bytes, expected 32")
    return raw
