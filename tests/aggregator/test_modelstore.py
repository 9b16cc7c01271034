"""ModelStore: atomic, content-addressed, signed model versions that survive crashes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from fedsec.aggregator.storage.models import ModelStore
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError, NotFound, PayloadTooLarge, SignatureError
from fedsec.modelfile import decode_model, encode_model, sha256_hex

FED = "fed-1"


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.zeros(3, np.float32)}


@pytest.fixture
def signer() -> SigningIdentity:
    return SigningIdentity.generate()


@pytest.fixture
def store(tmp_path: Path, signer: SigningIdentity) -> ModelStore:
    s = ModelStore(tmp_path, signer, FED)
    s.put(_arrays(1), parent=None, round=None, kind="initial", metrics={})
    s.put(_arrays(2), parent=1, round=1, kind="aggregate", metrics={"accuracy": 0.8})
    return s


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_put_assigns_versions_and_layout(store: ModelStore, tmp_path: Path) -> None:
    latest = store.latest()
    assert latest.version == 2 and latest.parent == 1 and latest.round == 1
    assert latest.metrics == {"accuracy": 0.8}
    data = store.read(2)
    assert sha256_hex(data) == latest.sha256
    assert (tmp_path / "models" / f"{latest.sha256}.safetensors").read_bytes() == data
    assert (tmp_path / "manifests" / "00000002.json").exists()
    out = decode_model(data, max_bytes=1 << 20)
    np.testing.assert_array_equal(out["w"], _arrays(2)["w"])
    assert [m.version for m in store.history()] == [1, 2]
    assert store.problems() == []


def test_empty_store_has_no_latest(tmp_path: Path, signer: SigningIdentity) -> None:
    with pytest.raises(NotFound):
        ModelStore(tmp_path, signer, FED).latest()
    with pytest.raises(NotFound):
        ModelStore(tmp_path, signer, FED).get(1)


def test_same_weights_share_one_file(store: ModelStore, tmp_path: Path) -> None:
    m = store.put(_arrays(1), parent=2, round=2, kind="aggregate", metrics={})
    assert m.sha256 == store.get(1).sha256
    assert len(list((tmp_path / "models").iterdir())) == 2


def test_reopen_sees_same_versions(
    store: ModelStore, tmp_path: Path, signer: SigningIdentity
) -> None:
    again = ModelStore(tmp_path, signer, FED)
    assert again.latest() == store.latest()


def test_partial_tmp_files_are_ignored_and_cleaned(
    store: ModelStore, tmp_path: Path, signer: SigningIdentity
) -> None:
    # Crash while writing the model file of version 3, and while writing its manifest.
    (tmp_path / "models" / f".{'a' * 64}.safetensors.tmp-99-abcd").write_bytes(b"\x00" * 10)
    (tmp_path / "manifests" / ".00000003.json.tmp-99-abcd").write_bytes(b'{"federa')
    assert store.latest().version == 2
    reopened = ModelStore(tmp_path, signer, FED)
    assert reopened.latest().version == 2
    leftovers = [p for p in tmp_path.rglob(".*") if p.is_file()]
    assert leftovers == []
    assert reopened.put(_arrays(3), parent=2, round=2, kind="aggregate", metrics={}).version == 3


def test_model_without_manifest_is_harmless(store: ModelStore, tmp_path: Path) -> None:
    # Crash after the model file was renamed into place but before the manifest.
    data = encode_model(_arrays(9))
    (tmp_path / "models" / f"{sha256_hex(data)}.safetensors").write_bytes(data)
    assert store.latest().version == 2
    assert store.problems() == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_model_file_falls_back(
    store: ModelStore, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = store.model_path(store.get(2).sha256)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-5])
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING):
        latest = store.latest()
    assert latest.version == 1
    (problem,) = store.problems()
    assert problem.version == 2
    assert "sha256" in problem.reason or "missing" in problem.reason
    assert "version=2" in caplog.text
    with pytest.raises(IntegrityError):
        store.read(2)
    assert [m.version for m in store.history()] == [1]


def test_garbage_manifest_falls_back(store: ModelStore, tmp_path: Path) -> None:
    (tmp_path / "manifests" / "00000003.json").write_bytes(b'{"federation_id": "fed-1", "ver')
    assert store.latest().version == 2
    assert [p.version for p in store.problems()] == [3]
    # A new put never reuses the number of a bad version.
    assert store.put(_arrays(5), parent=2, round=3, kind="aggregate", metrics={}).version == 4


def test_signature_tamper_detected(store: ModelStore, tmp_path: Path) -> None:
    path = tmp_path / "manifests" / "00000002.json"
    doc = json.loads(path.read_bytes())
    doc["metrics"]["accuracy"] = 0.99
    path.write_bytes(json.dumps(doc).encode())
    assert store.latest().version == 1
    with pytest.raises(SignatureError):
        store.get(2)
    assert "does not verify" in store.problems()[0].reason


def test_manifest_by_another_key_refused(store: ModelStore, tmp_path: Path) -> None:
    other = ModelStore(tmp_path / "other", SigningIdentity.generate(), FED)
    other.put(_arrays(1), parent=None, round=None, kind="initial", metrics={})
    other.put(_arrays(7), parent=1, round=1, kind="aggregate", metrics={})
    forged = other.manifest_path(2).read_bytes()
    (tmp_path / "manifests" / "00000003.json").write_bytes(
        forged.replace(b'"version":2', b'"version":3')
    )
    assert store.latest().version == 2


def test_manifest_under_wrong_filename_refused(store: ModelStore, tmp_path: Path) -> None:
    (tmp_path / "manifests" / "00000007.json").write_bytes(store.manifest_path(2).read_bytes())
    assert store.latest().version == 2
    assert "holds version 2, not 7" in store.problems()[0].reason


def test_other_federation_refused(tmp_path: Path, signer: SigningIdentity) -> None:
    a = ModelStore(tmp_path, signer, "fed-a")
    a.put(_arrays(1), parent=None, round=None, kind="initial", metrics={})
    b = ModelStore(tmp_path, signer, "fed-b")
    with pytest.raises(NotFound):
        b.latest()
    assert "fed-a" in b.problems()[0].reason


def test_bad_parent_refused_and_nothing_written(store: ModelStore, tmp_path: Path) -> None:
    before = _snapshot(tmp_path)
    with pytest.raises(IntegrityError, match="parent version 9"):
        store.put(_arrays(3), parent=9, round=2, kind="aggregate", metrics={})
    with pytest.raises(IntegrityError, match="NaN"):
        store.put(
            {"w": np.array([np.nan], np.float32)}, parent=2, round=2, kind="aggregate", metrics={}
        )
    assert _snapshot(tmp_path) == before


def test_rollback_republishes_old_file(store: ModelStore) -> None:
    m = store.rollback(1, note="v2 degraded accuracy")
    assert (m.version, m.parent, m.kind, m.note) == (3, 1, "rollback", "v2 degraded accuracy")
    assert m.sha256 == store.get(1).sha256
    assert store.latest() == m
    assert store.read(3) == store.read(1)


def test_corrupted_shared_file_is_repaired_by_put(store: ModelStore) -> None:
    sha = store.get(1).sha256
    store.model_path(sha).write_bytes(b"junk")
    assert store.latest().version == 2
    store.put(_arrays(1), parent=2, round=2, kind="aggregate", metrics={})
    assert store.get(1).sha256 == sha
    assert [m.version for m in store.history()] == [1, 2, 3]
    assert store.problems() == []


def test_durable_write_uses_fsync(
    tmp_path: Path, signer: SigningIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ModelStore(tmp_path, signer, FED).put(
        _arrays(1), parent=None, round=None, kind="initial", metrics={}
    )
    # model file + its directory, manifest + its directory
    assert len(synced) == 4


_CRASH_SCRIPT = """
import os, sys
from pathlib import Path
import numpy as np
from fedsec.aggregator.storage import models as modelstore
from fedsec.crypto.identity import SigningIdentity

root, seed, target = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3]
real_replace = os.replace

def crashing_replace(src, dst):
    if target in str(dst):
        os._exit(3)  # the process dies mid-write: tmp file written and fsynced, not renamed
    real_replace(src, dst)

modelstore.os.replace = crashing_replace
store = modelstore.ModelStore(root, SigningIdentity(seed), "fed-1")
store.put({"w": np.full(3, 7.0, np.float32)}, parent=2, round=2, kind="aggregate", metrics={})
"""


@pytest.mark.parametrize("crash_at", ["models", "manifests"])
def test_real_crash_mid_write_keeps_previous_version(tmp_path: Path, crash_at: str) -> None:
    import subprocess
    import sys

    seed = os.urandom(32)
    signer = SigningIdentity(seed)
    store = ModelStore(tmp_path, signer, FED)
    store.put(_arrays(1), parent=None, round=None, kind="initial", metrics={})
    store.put(_arrays(2), parent=1, round=1, kind="aggregate", metrics={})
    result = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(tmp_path), seed.hex(), crash_at],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr.decode()
    assert list((tmp_path / crash_at).glob(".*.tmp-*")), "the crash should leave a temp file"
    reopened = ModelStore(tmp_path, signer, FED)
    assert reopened.latest().version == 2
    assert reopened.problems() == []
    assert not list(tmp_path.rglob(".*.tmp-*"))
    assert reopened.put(_arrays(3), parent=2, round=2, kind="aggregate", metrics={}).version == 3


def test_read_arrays_reads_the_file_a_tensor_at_a_time_and_checks_its_hash(
    store: ModelStore,
) -> None:
    arrays = store.read_arrays(2, max_bytes=1 << 20)
    expected = decode_model(store.read(2), max_bytes=1 << 20)
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():
        assert arrays[name].flags.writeable
        np.testing.assert_array_equal(arrays[name], value)
    # the same length and timestamps, other bytes: the verified-manifest cache keeps
    # them from get(), so read_arrays' own hash is what refuses them
    path = store.model_path(store.get(2).sha256)
    stat = path.stat()
    tampered = bytearray(path.read_bytes())
    tampered[-1] ^= 0x01  # a low exponent bit of the last float: still finite
    path.write_bytes(bytes(tampered))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(IntegrityError, match="does not match manifest v2"):
        store.read_arrays(2, max_bytes=1 << 20)
    with pytest.raises(PayloadTooLarge):
        store.read_arrays(1, max_bytes=16)


def test_read_arrays_into_a_models_own_arrays_holds_no_copy(store: ModelStore) -> None:
    # the aggregator reads the parent into its model's tensors: the arrays it gets back
    # are views of those, holding the file's values
    own = {"w": np.zeros((3, 2), np.float32), "b": np.full(3, 7.0, np.float32)}
    arrays = store.read_arrays(2, max_bytes=1 << 20, into=own)
    for name, value in decode_model(store.read(2), max_bytes=1 << 20).items():
        np.testing.assert_array_equal(own[name], value)
        assert np.shares_memory(arrays[name], own[name])


@pytest.mark.parametrize(
    "own",
    [
        {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)},  # a shape
        {"w": np.zeros((3, 2), np.float32)},  # a tensor short
        {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32), "c": np.zeros(1)},
    ],
)
def test_read_arrays_into_arrays_of_another_model_changes_none(
    store: ModelStore, own: dict[str, np.ndarray]
) -> None:
    before = {name: value.copy() for name, value in own.items()}
    with pytest.raises((IntegrityError, ValueError)):
        store.read_arrays(2, max_bytes=1 << 20, into=own)
    for name, value in own.items():
        np.testing.assert_array_equal(value, before[name])


def _settle(store: ModelStore) -> None:
    """Date manifests/ a minute back, so latest() may keep its listing from now on."""
    st = os.stat(store.manifests_dir)
    os.utime(store.manifests_dir, ns=(st.st_atime_ns, st.st_mtime_ns - 60 * 10**9))


def test_a_kept_listing_sees_what_another_process_publishes(
    store: ModelStore, tmp_path: Path, signer: SigningIdentity
) -> None:
    _settle(store)
    assert store.latest().version == 2
    assert store.latest().version == 2  # from the kept listing
    other = ModelStore(tmp_path, signer, FED)  # `fedsec aggregator rollback`'s own store
    assert other.rollback(1).version == 3
    assert store.latest().version == 3
    assert store.rollback(2).version == 4  # its own write, within the same second
    assert store.latest().version == 4 and other.latest().version == 4


def test_a_listing_made_within_a_timestamp_tick_of_a_change_is_not_kept(
    store: ModelStore, tmp_path: Path, signer: SigningIdentity
) -> None:
    # a file added in the tick of the directory's last change leaves its mtime as it was
    # (coarse clocks): simulated by putting that mtime back after another process's write
    before = os.stat(store.manifests_dir)
    assert store.latest().version == 2
    ModelStore(tmp_path, signer, FED).rollback(1)
    os.utime(store.manifests_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.latest().version == 3


def test_a_kept_listing_still_checks_the_newest_files(store: ModelStore) -> None:
    _settle(store)
    assert store.latest().version == 2
    path = store.model_path(store.get(2).sha256)
    path.write_bytes(path.read_bytes()[:-5])
    assert store.latest().version == 1
