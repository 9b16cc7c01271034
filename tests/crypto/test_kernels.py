"""The compiled loops: ``warm`` covers every type combination fedsec calls them with,
so no process compiles in the middle of a round."""

from __future__ import annotations

import hashlib

import numpy as np

from fedsec.crypto import discretize as dz
from fedsec.crypto import kernels
from fedsec.crypto.quantize import QuantSpec, quantize
from fedsec.crypto.rotation import rotate, rotate_single, unrotate

SEED = hashlib.sha256(b"kernels").digest()
_LOOPS = (
    kernels._signed_hadamard,
    kernels._hadamard_inplace,
    kernels._squared_norm,
    kernels._round_draw,
    kernels._add_noise_and_wrap,
    kernels._apply_signs,
    kernels._quantize_round,
)


def _signatures() -> list[int]:
    return [len(loop.signatures) for loop in _LOOPS]


def test_warm_compiles_every_variant_the_encoders_and_decoders_use() -> None:
    assert kernels.warm() == 21
    before = _signatures()
    x = np.random.default_rng(0).standard_normal(300)
    spec = dz.DdpSpec(300, 24, 5.0, 1.0, 1.0, 3, 4)
    for vector in (x, x.astype(np.float32)):
        dz.encode(vector, spec, SEED, SEED, integers=True)
    y = rotate(x, SEED, scale=50.0)
    for ring_bits in (8, 16, 32, 40):  # every ring dtype
        # a small variance (an int16 guide) and one whose table passes 2^15 (int32)
        for variance in (9.0, 2.0e7):
            dz._discretise(y, 1e9, SEED, ring_bits, variance, dz._Workspace().get(y.size))
    unrotate(y, SEED, 300)
    unrotate(rotate_single(x.astype(np.float32), SEED), SEED, 300)
    dz.skellam(SEED, 9.0, 10)
    for ring_bits in (7, 12, 20, 40):  # the plain quantizer into every ring dtype
        quantize(x, 0.5, QuantSpec(6, 1.0, ring_bits), SEED)
    assert _signatures() == before
