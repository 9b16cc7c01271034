"""The aggregator's store of model versions: content-addressed files, signed manifests.

Layout under ``root``::

    models/<sha256>.safetensors    model bytes, named by their hash
    manifests/<version:08d>.json   signed ModelManifest for each version

Every write goes to a temporary file in the same directory, is fsynced, renamed into
place and the directory fsynced, so a file is either complete or absent.  The model
file is written before the manifest that names it, so a crash can leave an orphan
model file (harmless, reused if the same weights are stored again) but never a
manifest without its model.  Whatever else is found on disk (a truncated model, a
manifest that does not verify) is reported and skipped: :meth:`ModelStore.latest`
returns the newest version that verifies end to end.

One process writes a store at a time (the aggregator); readers in the same process are
serialised by a lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import FedsecError, IntegrityError, NotFound, PayloadTooLarge
from fedsec.fsio import TMP_MARK, atomic_write, atomic_write_with
from fedsec.modelfile import (
    ManifestKind,
    ModelManifest,
    manifest_from_json,
    manifest_to_json,
    model_sha256,
    read_model,
    sha256_hex,
    sign_manifest,
    verify_manifest,
    write_model,
)

log = logging.getLogger(__name__)

_MANIFEST_NAME = re.compile(r"^(\d{8})\.json$")
# latest() trusts its last listing of manifests/ while the directory's (mtime, inode) is
# unchanged, but only a listing made this long after the directory's last change: a
# file added within the same timestamp tick as that change (coarse kernel clocks, 1-2 s
# on some filesystems) would leave its mtime as it was.
_LISTING_SETTLED_NS = 5_000_000_000
# Temporary files are dot-files so no reader ever mistakes one for a finished file.


@dataclass(frozen=True)
class StoreProblem:
    """A version on disk that was skipped, and why."""

    version: int
    reason: str


class ModelStore:
    """Model versions of one federation, signed by the aggregator."""

    def __init__(self, root: Path, signer: SigningIdentity, federation_id: str) -> None:
        """Open (creating if needed) the store at ``root`` and remove leftover temp files."""
        self.root = Path(root)
        self.models_dir = self.root / "models"
        self.manifests_dir = self.root / "manifests"
        self._signer = signer
        self._public = signer.public_bytes
        self.federation_id = federation_id
        self._lock = threading.RLock()
        # version -> (manifest stat, model stat) of the files last verified good, so
        # latest() does not rehash a large model on every call.
        self._verified: dict[int, tuple[tuple[int, int], tuple[int, int], ModelManifest]] = {}
        self._problems: dict[int, str] = {}
        # (manifests/ mtime and inode, its versions), see _LISTING_SETTLED_NS
        self._listing: tuple[tuple[int, int], list[int]] | None = None
        # the directories as strings: stat() on a str skips pathlib's parsing, which
        # cost latest() more than its system calls (it answers every round poll)
        self._models_str = str(self.models_dir)
        self._manifests_str = str(self.manifests_dir)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.manifests_dir.mkdir(parents=True, exist_ok=True)
        self._remove_leftover_tmp_files()

    # -- writing -------------------------------------------------------------------

    def put(
        self,
        arrays: Mapping[str, npt.ArrayLike],
        *,
        parent: int | None,
        round: int | None,
        kind: ManifestKind,
        metrics: Mapping[str, float],
        note: str = "",
    ) -> ModelManifest:
        """Store a new model version.

        The version number is one more than the highest manifest on disk, even an
        unverifiable one, so a number once published is never reused.

        Args:
            arrays: tensor name -> array (encoded as float32 safetensors).
            parent: the version this one derives from, or None for an initial model.
            round: the round that produced it, if any.
            kind: "initial", "aggregate" or "rollback".
            metrics: validation metrics to record (finite floats).
            note: free text (e.g. an operator's rollback reason).

        Returns:
            The signed manifest of the new version.

        Raises:
            IntegrityError: bad arrays, metrics, or a parent that is not a good version.
        """
        sha = model_sha256(arrays)  # refuses bad arrays before anything is written
        with self._lock:
            self._check_parent(parent)
            if not self._has_model(sha):
                # streamed a tensor at a time: the file is never held whole
                written = atomic_write_with(self.model_path(sha), partial(write_model, arrays))
                if written != sha:
                    raise IntegrityError(f"model arrays changed while being stored ({sha})")
            return self._publish(
                sha, parent=parent, round=round, kind=kind, metrics=metrics, note=note
            )

    def put_sealed(self, data: bytes, *, parent: int, round: int) -> ModelManifest:
        """Store a hidden model version: the custodian's sealed release, as received
        (the aggregator cannot read the model inside; the manifest names these bytes).

        Raises:
            IntegrityError: a parent that is not a good version.
        """
        with self._lock:
            self._check_parent(parent)
            sha = sha256_hex(data)
            if not self._has_model(sha):
                atomic_write(self.model_path(sha), data)
            return self._publish(
                sha, parent=parent, round=round, kind="sealed", metrics={}, note=""
            )

    def rollback(self, to_version: int, *, note: str = "") -> ModelManifest:
        """Publish an older good version again as the newest (kind "rollback").

        The new version has ``parent=to_version``, the same file and metrics.

        Raises:
            NotFound / IntegrityError: ``to_version`` is missing or does not verify.
        """
        with self._lock:
            target = self.get(to_version)
            return self._publish(
                target.sha256,
                parent=to_version,
                round=target.round,
                kind="rollback",
                metrics=target.metrics,
                note=note,
            )

    def _check_parent(self, parent: int | None) -> None:
        if parent is None:
            return
        try:
            self.get(parent)
        except FedsecError as exc:
            raise IntegrityError(f"parent version {parent} is not a good version: {exc}") from None

    def _has_model(self, sha: str) -> bool:
        """Whether the model file named ``sha`` is on disk and holds those bytes (a file
        that does not is rewritten)."""
        path = self.model_path(sha)
        if not path.exists():
            return False
        try:
            if sha256_hex(path.read_bytes()) == sha:
                return True
        except OSError:
            pass
        log.warning("model_file_rewritten sha256=%s reason=content_mismatch", sha)
        return False

    def _publish(
        self,
        sha: str,
        *,
        parent: int | None,
        round: int | None,
        kind: ManifestKind,
        metrics: Mapping[str, float],
        note: str,
    ) -> ModelManifest:
        version = self._highest_version_on_disk() + 1
        manifest = sign_manifest(
            federation_id=self.federation_id,
            version=version,
            parent=parent,
            round=round,
            sha256=sha,
            metrics=metrics,
            kind=kind,
            note=note,
            signer=self._signer,
        )
        atomic_write(self.manifest_path(version), manifest_to_json(manifest))
        self._listing = None
        log.info("model_version_stored version=%d sha256=%s kind=%s", version, sha, kind)
        return manifest

    # -- reading -------------------------------------------------------------------

    def model_path(self, sha256: str) -> Path:
        """Where the model file with this hash lives (it may not exist)."""
        return Path(self._model_file(sha256))

    def manifest_path(self, version: int) -> Path:
        """Where the manifest of ``version`` lives (it may not exist)."""
        return Path(self._manifest_file(version))

    def _model_file(self, sha256: str) -> str:
        return os.path.join(self._models_str, f"{sha256}.safetensors")

    def _manifest_file(self, version: int) -> str:
        return os.path.join(self._manifests_str, f"{version:08d}.json")

    def versions_on_disk(self) -> list[int]:
        """Every version number with a manifest file, verified or not, ascending."""
        found = []
        for entry in os.scandir(self.manifests_dir):
            match = _MANIFEST_NAME.fullmatch(entry.name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def _highest_version_on_disk(self) -> int:
        versions = self.versions_on_disk()
        return versions[-1] if versions else 0

    def get(self, version: int) -> ModelManifest:
        """The verified manifest of ``version``.

        Raises:
            NotFound: no manifest for this version.
            IntegrityError / SignatureError: it, or its model file, does not verify.
        """
        with self._lock:
            try:
                manifest = self._verify(version)
            except FedsecError as exc:
                if not isinstance(exc, NotFound):
                    self._report(version, exc.detail)
                raise
            self._problems.pop(version, None)
            return manifest

    def read(self, version: int) -> bytes:
        """The model file of ``version``, checked against its signed manifest.

        Raises:
            NotFound, IntegrityError, SignatureError: as for :meth:`get`.
        """
        with self._lock:
            manifest = self.get(version)
            data = self._read_model(version, manifest.sha256)
            verify_manifest(manifest, self._public, data, federation_id=self.federation_id)
            return data

    def read_arrays(
        self,
        version: int,
        *,
        max_bytes: int,
        into: Mapping[str, npt.NDArray[np.float32]] | None = None,
    ) -> dict[str, npt.NDArray[np.float32]]:
        """The tensors of ``version``'s model file, read a tensor at a time (the file's
        bytes are never held whole) and checked against its signed manifest.

        Args:
            version: the model version.
            max_bytes: refuse a larger file.
            into: arrays to read the tensors into (:func:`fedsec.modelfile.read_model`);
                on an error they may hold part of the file.

        Raises:
            NotFound, SignatureError: as for :meth:`get`.
            IntegrityError: as for :meth:`get`, a malformed file
                (:func:`fedsec.modelfile.read_model`), or bytes that are not the ones the
                manifest names.
            PayloadTooLarge: the file is larger than ``max_bytes``.
            ValueError: an array of ``into`` is not contiguous writable ``<f4``.
        """
        with self._lock:
            manifest = self.get(version)
            path = self.model_path(manifest.sha256)
            try:
                with path.open("rb") as source:
                    size = os.fstat(source.fileno()).st_size
                    if size > max_bytes:
                        raise PayloadTooLarge(
                            f"model file is {size} bytes, the limit is {max_bytes}"
                        )
                    arrays, sha = read_model(source, size, into=into)
            except FileNotFoundError:
                raise IntegrityError(
                    f"model file {manifest.sha256}.safetensors of version {version} is missing"
                ) from None
            if sha != manifest.sha256:
                raise IntegrityError(
                    f"model file sha256 {sha} does not match manifest v{version} "
                    f"sha256 {manifest.sha256}"
                )
            return arrays

    def latest(self) -> ModelManifest:
        """The newest version whose manifest and model file both verify.

        Newer versions that do not verify are logged, listed by :meth:`problems`, and
        skipped.

        Raises:
            NotFound: the store holds no good version.
        """
        with self._lock:
            for version in reversed(self._versions_listed()):
                try:
                    return self.get(version)
                except FedsecError:
                    continue
            raise NotFound(f"model store {self.root} holds no verified model version")

    def history(self) -> list[ModelManifest]:
        """Every good version, oldest first (bad ones are reported and left out)."""
        with self._lock:
            good = []
            for version in self.versions_on_disk():
                try:
                    good.append(self.get(version))
                except FedsecError:
                    continue
            return good

    def problems(self) -> list[StoreProblem]:
        """Versions found bad by the last look at them, oldest first."""
        with self._lock:
            return [StoreProblem(v, r) for v, r in sorted(self._problems.items())]

    # -- internals -------------------------------------------------------------------

    def _versions_listed(self) -> list[int]:
        """:meth:`versions_on_disk`, listed again only when ``manifests/`` changed (see
        ``_LISTING_SETTLED_NS``); a round poll no longer reads a directory that gains
        a file a round."""
        st = os.stat(self._manifests_str)  # before the listing: a later change shows
        key = (st.st_mtime_ns, st.st_ino)
        listing = self._listing
        if listing is not None and listing[0] == key:
            return listing[1]
        listed_at = time.time_ns()
        versions = self.versions_on_disk()
        settled = key[0] < listed_at - _LISTING_SETTLED_NS
        self._listing = (key, versions) if settled else None
        return versions

    def _verify(self, version: int) -> ModelManifest:
        try:
            mstat = os.stat(self._manifest_file(version))
        except FileNotFoundError:
            raise NotFound(f"model version {version} does not exist") from None
        manifest_key = (mstat.st_mtime_ns, mstat.st_size)
        cached = self._verified.get(version)
        if cached is not None and cached[0] == manifest_key:
            model_key = self._stat_key(self._model_file(cached[2].sha256))
            if model_key == cached[1]:
                return cached[2]
        self._verified.pop(version, None)
        mpath = self.manifest_path(version)
        manifest = manifest_from_json(mpath.read_bytes())
        if manifest.version != version:
            raise IntegrityError(
                f"manifest file {mpath.name} holds version {manifest.version}, not {version}"
            )
        verify_manifest(manifest, self._public, federation_id=self.federation_id)
        model_file = self.model_path(manifest.sha256)
        model_key = self._stat_key(model_file)
        data = self._read_model(version, manifest.sha256)
        verify_manifest(manifest, self._public, data, federation_id=self.federation_id)
        if model_key is not None:
            self._verified[version] = (manifest_key, model_key, manifest)
        return manifest

    def _read_model(self, version: int, sha: str) -> bytes:
        try:
            return self.model_path(sha).read_bytes()
        except FileNotFoundError:
            raise IntegrityError(
                f"model file {sha}.safetensors of version {version} is missing"
            ) from None

    @staticmethod
    def _stat_key(path: Path | str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _report(self, version: int, reason: str) -> None:
        if self._problems.get(version) != reason:
            log.warning("model_version_skipped version=%d reason=%r", version, reason)
        self._problems[version] = reason

    def _remove_leftover_tmp_files(self) -> None:
        for directory in (self.models_dir, self.manifests_dir):
            for entry in os.scandir(directory):
                if entry.name.startswith(".") and TMP_MARK in entry.name:
                    log.info("leftover_tmp_removed path=%s", entry.path)
                    Path(entry.path).unlink(missing_ok=True)
