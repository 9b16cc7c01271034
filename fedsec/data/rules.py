"""The owner's column rules: rename, exclude, anonymise, declare units.

``[data.rules]`` in ``agent.toml`` maps this member's columns onto the federation's
schema.  Rules run on each chunk before anything is typed or encoded, so a column the
rules drop or transform is never read into training in its raw form.

Anonymisation, per column:

- ``drop``: the column stays inside (as ``exclude``, said where it matters);
- ``hash``: keyed BLAKE2b (the member's own 32-byte key, file mode 0600), 16 bytes hex:
  equal values stay equal within this member, and nobody without the key can test a
  guess; the key never leaves the agent;
- ``generalise:prefix:N``: the first N characters (post codes to districts);
- ``generalise:bucket:W``: numbers floored to a multiple of W (age 47 → 40 with W=10);
- ``generalise:year``: a date reduced to its year.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedsec.data.profile import NUMBER_PATTERN, as_text
from fedsec.data.settings import GENERALISE_RULE, ColumnRules
from fedsec.errors import ConfigError

HASH_KEY_BYTES = 32  # BLAKE2b's full key size: 256 bits of secret, no weaker than the hash
HASH_DIGEST_BYTES = 16  # 128 bits: no collisions among any table's values in practice


@dataclass(frozen=True)
class RuleAction:
    """What the rules do with one source column, for the data map."""

    column: str  # the source's name
    becomes: str  # the name after renaming
    action: str  # "kept", "excluded", "dropped", "hashed", "generalised (...)"


def plan(rules: ColumnRules, columns: list[str]) -> list[RuleAction]:
    """What happens to each of a source's columns."""
    out = []
    for col in columns:
        name = rules.rename.get(col, col)
        rule = rules.anonymise.get(name, "")
        if col in rules.exclude or name in rules.exclude:
            action = "excluded (stays inside)"
        elif rule == "drop":
            action = "dropped by anonymisation (stays inside)"
        elif rule == "hash":
            action = "keyed hash"
        elif rule:
            action = "generalised (" + rule.split(":", 1)[1] + ")"
        else:
            action = "kept"
        out.append(RuleAction(col, name, action))
    return out


def apply(
    rules: ColumnRules, columns: dict[str, pa.Array], hash_key: bytes | None
) -> dict[str, pa.Array]:
    """One chunk after the rules: renamed, excluded and dropped columns removed,
    anonymised columns transformed; every value as trimmed text, missing as null.

    Raises:
        ConfigError: a hash rule without a key, a bucket rule on a non-number.
    """
    out: dict[str, pa.Array] = {}
    for action in plan(rules, list(columns)):
        if action.action.startswith(("excluded", "dropped")):
            continue
        text = as_text(columns[action.column])
        rule = rules.anonymise.get(action.becomes, "")
        if rule == "hash":
            text = _keyed_hash(text, hash_key, action.becomes)
        elif rule:
            text = _generalise(text, rule, action.becomes)
        out[action.becomes] = text
    return out


def _keyed_hash(text: pa.Array, key: bytes | None, column: str) -> pa.Array:
    if key is None or len(key) != HASH_KEY_BYTES:
        raise ConfigError(f"data.rules.anonymise.{column} = hash needs the member's hash key")
    return pa.array(
        [
            None
            if v is None
            else hashlib.blake2b(v.encode(), key=key, digest_size=HASH_DIGEST_BYTES).hexdigest()
            for v in text.to_pylist()
        ],
        type=pa.string(),
    )


def _generalise(text: pa.Array, rule: str, column: str) -> pa.Array:
    match = GENERALISE_RULE.match(rule)
    assert match is not None  # ColumnRules.check ran
    if match.group("prefix"):
        return pc.utf8_slice_codeunits(text, 0, int(match.group("prefix")))
    if match.group("bucket"):
        width = float(match.group("bucket"))
        numeric = pc.fill_null(pc.match_substring_regex(text, NUMBER_PATTERN), True)
        if not pc.all(numeric).as_py():
            raise ConfigError(f"data.rules.anonymise.{column}: bucketing needs numbers")
        values = pc.cast(text, pa.float64()).to_numpy(zero_copy_only=False)
        floored = np.floor(values / width) * width
        return pa.array([None if np.isnan(v) else f"{v:g}" for v in floored], type=pa.string())
    years = pc.extract_regex(text, r"(?P<year>(?:19|20)\d{2})")
    return pc.struct_field(years, "year")


def load_hash_key(path: str) -> bytes:
    """The member's anonymisation key, created (0600) on first use.

    Raises:
        ConfigError: the key file is readable by others or has the wrong size.
    """
    import os
    from pathlib import Path

    from fedsec.data.sources import check_private_file
    from fedsec.fsio import atomic_write

    key_path = Path(path)
    if not key_path.exists():
        atomic_write(key_path, os.urandom(HASH_KEY_BYTES), mode=0o600, parents_mode=0o700)
    check_private_file(key_path, "anonymisation key")
    key = key_path.read_bytes()
    if len(key) != HASH_KEY_BYTES:
        raise ConfigError(f"anonymisation key {key_path} must be {HASH_KEY_BYTES} bytes")
    return key
