"""One exception hierarchy: each class defined once, reachable as ``fedsec.errors.X``.

The root and the crypto layer's errors live in :mod:`fedsec.crypto.errors` (crypto
imports nothing of fedsec outside itself); :mod:`fedsec.errors` re-exports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fedsec.crypto
from fedsec import errors
from fedsec.aggregator_client import _ERROR_CLASSES
from fedsec.crypto import errors as crypto_errors


def _public_errors() -> dict[str, type[errors.FedsecError]]:
    return {name: getattr(errors, name) for name in errors.__all__}


def test_every_crypto_error_is_the_same_class_under_fedsec_errors() -> None:
    for name in crypto_errors.__all__:
        assert getattr(errors, name) is getattr(crypto_errors, name), name
        assert name in errors.__all__


def test_one_root_and_unique_codes() -> None:
    public = _public_errors()
    assert all(issubclass(cls, errors.FedsecError) for cls in public.values())
    codes = [cls.code for cls in public.values()]
    assert len(codes) == len(set(codes))


def test_the_client_maps_every_public_error_code_to_its_class() -> None:
    """An aggregator's ``{"error": code}`` comes back as the very class it raised."""
    expected = {
        cls.code: cls for cls in _public_errors().values() if cls is not errors.AggregatorRefused
    }
    assert expected == _ERROR_CLASSES


def test_crypto_imports_nothing_of_fedsec_outside_crypto() -> None:
    root = Path(fedsec.crypto.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name == "fedsec" or name.startswith("fedsec."):
                    assert name.startswith("fedsec.crypto"), f"{path}: imports {name}"
