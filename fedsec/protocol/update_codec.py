"""The update codec: how a member turns its update into ring elements before masking,
and how the ring sum of a round turns back into (Σ w·Δ, Σ w).

One definition for every party: the member encodes with it (``fedsec.agent``), the
aggregator decodes the unmasked or decrypted sum with it, and the auditor replays it;
all of them derive it from the signed round spec alone (:func:`codec_for`), so decoding
is part of the signed, replayable recipe.

Three kinds, each a chain of optional stages named in the spec:

``plain`` (the default :class:`~fedsec.protocol.wire.CodecSpec`)
    clip to ``clip_norm``, weight, round each coordinate stochastically over
    [−clip, clip] to ``quant_bits`` bits (:func:`fedsec.crypto.quantize.quantize`).

``compressed`` (rotation, a keep fraction below 1, or a rounding range)
    clip, weight, **rotate** with the round's shared randomised Hadamard transform,
    keep the round's **shared random subset** of k coordinates, round each kept
    coordinate stochastically to ``quant_bits`` bits over the **shared** range ±s
    (s = ``range_stddevs``·clip/√N: a rotated coordinate of a vector of norm ≤ clip is
    close to N(0, clip²/N), so a few standard deviations hold almost all of them;
    coordinates beyond are saturated and counted).  Every stage is the same linear map
    for every member, so the sum of encodings decodes to the encoding of the sum:
    scatter the k sums back, rescale, unrotate.  Without error feedback the decoder
    multiplies the scattered sum by N/k, so the estimate of Σ w·Δ is unbiased; with it,
    each member carries what was not sent into its next round instead (rescaling would
    then count it twice).

``distributed`` (``dp.mode = "distributed"``)
    the Distributed Skellam pipeline of :mod:`fedsec.crypto.discretize` (rotate, scale,
    conditional rounding, a noise share, modular clipping), then the weight as one
    non-negative integer, unrotated after recentring.

**Fewer headroom bits** (compressed kind, ``headroom_bits``): the ring keeps b + h bits
with h below ⌈log₂ n⌉, so the sum of a coordinate over the cohort may wrap.  The decoder
recentres each sum around the n offsets (a centred sum beyond ± half the ring wraps and
lands near the far edge, where :meth:`UpdateCodec.edge_count` counts it), and the weight,
which must not wrap, travels as digits small enough that a cohort's sum of each fits.

Per-member top-k is not offered: the kept subset would depend on the member's data and
the sum of differently sparsified vectors is no longer one linear map.

In every kind the last coordinates carry the member's weight (one element, or its
digits), so one secure sum yields both the weighted sum and the total weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedsec.crypto import prg, rotation
from fedsec.crypto.discretize import DdpSpec, recentre
from fedsec.crypto.discretize import encode as ddp_encode
from fedsec.crypto.quantize import (
    QuantSpec,
    RingVector,
    clip_l2,
    dequantize_run,
    dequantize_sum,
    quantize,
    unpack,
    unpack_runs,
)
from fedsec.errors import BadVector, QuantizationError
from fedsec.protocol import decode_space
from fedsec.protocol.codec_subset import kept_runs, subset

_ROUNDING_DOMAIN = b"codec/rounding"
_WEIGHT_DOMAIN = b"codec/weight"
# A wrapped centred sum that overshot the ring's half range by less than this fraction
# of it lands this close to the far edge; edge_count counts sums there as likely wraps.
WRAP_EDGE_FRACTION = 1 / 8
# Coordinates decoded at a time: a run's int64 and float64 temporaries stay near 4 MB
# whatever the model's size, where whole-vector temporaries and the subset's index cost
# about 40 bytes a coordinate; above 2^16 the per-run overhead of the numpy calls is
# below 1 % of the run's work.
DECODE_BLOCK = 1 << 18


@dataclass(frozen=True, slots=True)
class Encoded:
    """One member's encoded update and what the codec did to it."""

    ring: RingVector  # the codec's length: kept coordinates, then the weight's element(s)
    sent: npt.NDArray[np.float64] | None  # error feedback: what the sum will count of it
    saturated: int  # coordinates clamped to the rounding range (compressed kind)


@dataclass(frozen=True, slots=True)
class UpdateCodec:
    """A round's codec, derived from the spec by :func:`codec_for`.

    Attributes:
        kind: "plain", "compressed" or "distributed".
        quant: bits, clip and ring of the round.
        dim: d, the update's length.
        rotation_seed: the shared rotation (None: no rotation).
        keep: k, coordinates sent before the weight.
        subset_seed: the shared subset (None: every coordinate, in order).
        range: s, the rounding range ±s of a sent coordinate (compressed kind).
        rescale: what the decoder multiplies the scattered sum by (N/k or 1).
        ddp: the distributed-DP discretisation (distributed kind only).
        error_feedback: members carry what was not sent into the next round.
        cohort: n, the members whose sum the ring holds (compressed kind).
        weight_digit_bits: q, bits of each weight element when the ring has fewer
            headroom bits than n needs (:attr:`wraps`) and the weight travels as digits,
            so n·(2^q − 1) fits the ring; 0: no wrapping, the weight is one element.
    """

    kind: str
    quant: QuantSpec
    dim: int
    rotation_seed: bytes | None
    keep: int
    subset_seed: bytes | None
    range: float
    rescale: float
    ddp: DdpSpec | None
    error_feedback: bool
    cohort: int = 0
    weight_digit_bits: int = 0

    @property
    def wraps(self) -> bool:
        """The ring has fewer headroom bits than the cohort needs: sums decode centred."""
        return self.weight_digit_bits > 0

    @property
    def may_wrap(self) -> bool:
        """Whether a sum of this codec's inputs can wrap the ring (:meth:`edge_count`)."""
        return self.ddp is not None or self.wraps

    @property
    def weight_elements(self) -> int:
        """Elements that carry the weight, after the kept coordinates."""
        if not self.weight_digit_bits:
            return 1
        return -(-self.quant.bits // self.weight_digit_bits)

    @property
    def length(self) -> int:
        """Elements of an encoded update, the weight included."""
        return self.keep + self.weight_elements

    @property
    def padded(self) -> int:
        """Coordinates after rotation (d without one)."""
        return rotation.padded_length(self.dim) if self.rotation_seed is not None else self.dim

    def subset(self) -> npt.NDArray[np.intp] | None:
        """The shared kept coordinates, ascending (None: all of them)."""
        if self.subset_seed is None:
            return None
        return subset(self.subset_seed, self.padded, self.keep)

    # -- member side ---------------------------------------------------------------

    def encode(self, delta: npt.ArrayLike, weight: float, secret_seed: bytes) -> Encoded:
        """Clip, weight and encode ``delta``; the weight goes last.

        Args:
            delta: the update (``dim`` values, any shape); not modified.
            weight: w in [0, 1]; in the distributed kind a non-negative number below
                :meth:`max_weight` (rounded stochastically to an integer).
            secret_seed: 32 fresh secret bytes of this member (rounding, noise).

        Raises:
            QuantizationError: wrong length, non-finite values or a weight out of range.
        """
        flat = np.asarray(delta, dtype=np.float32).reshape(-1)
        if flat.size != self.dim:
            raise QuantizationError(f"update must have {self.dim} values, got {flat.size}")
        if self.kind == "plain":
            return Encoded(quantize(flat, weight, self.quant, secret_seed), None, 0)
        if self.kind == "distributed":
            return self._encode_distributed(flat, weight, secret_seed)
        return self._encode_compressed(flat, weight, secret_seed)

    def _encode_compressed(
        self, flat: npt.NDArray[np.float32], weight: float, seed: bytes
    ) -> Encoded:
        if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
            raise QuantizationError(f"weight must be in [0, 1], got {weight}")
        if not np.all(np.isfinite(flat)):
            raise QuantizationError("update contains NaN or infinite values")
        x = clip_l2(flat, self.quant.clip) * np.float32(weight)
        if self.rotation_seed is not None:
            # single precision: its error (~2^-20 of a coordinate) vanishes under the
            # rounding to a few bits that follows, and the decoder works in float64
            x = rotation.rotate_single(x, self.rotation_seed)
        idx = self.subset()
        kept = (x[idx] if idx is not None else x).astype(np.float64)
        levels, s = self.quant.levels, self.range
        # float64 from here: up to 16 bits of levels keep 36 bits for the fraction that
        # the stochastic rounding must not bias
        y = (kept + s) * (levels / (2.0 * s))
        saturated = int(np.count_nonzero((y < 0) | (y > levels)))
        np.clip(y, 0.0, float(levels), out=y)
        y += prg.uniform01(seed, _ROUNDING_DOMAIN, y.size)
        np.floor(y, out=y)
        np.minimum(y, float(levels), out=y)
        out = np.empty(self.length, dtype=self.quant.dtype)
        out[: self.keep] = y
        out[self.keep :] = self._weight_digits(_round_weight(weight * levels, seed))
        if not self.error_feedback:
            return Encoded(out, None, saturated)
        sent = self._scatter(out[: self.keep].astype(np.float64) * (2.0 * s / levels) - s, 1.0)
        return Encoded(out, sent, saturated)

    def _encode_distributed(
        self, flat: npt.NDArray[np.float32], weight: float, seed: bytes
    ) -> Encoded:
        assert self.ddp is not None and self.rotation_seed is not None
        if not (math.isfinite(weight) and 0.0 <= weight <= self.max_weight()):
            raise QuantizationError(
                f"a distributed-DP weight must be in [0, {self.max_weight()}], got {weight}"
            )
        enc = ddp_encode(flat, self.ddp, self.rotation_seed, seed)
        out = np.empty(self.length, dtype=self.quant.dtype)
        out[:-1] = enc.ring
        out[-1] = _round_weight(weight, seed)
        return Encoded(out, None, 0)

    def max_weight(self) -> float:
        """The largest weight a member may send: in the distributed kind, the cohort's
        weights must sum below half the ring; else 1."""
        if self.ddp is None:
            return 1.0
        return float((1 << (self.quant.ring_bits - 1)) // (self.ddp.max_members + 1) - 1)

    # -- aggregator and auditor side -----------------------------------------------

    def check_input(self, vector: RingVector) -> None:
        """Refuse one member's unmasked input that no honest encoding produces.

        Raises:
            BadVector: wrong length, or values outside the kind's range.
        """
        v = np.asarray(vector).reshape(-1)
        if v.size != self.length:
            raise BadVector(f"an encoded update has {self.length} elements, got {v.size}")
        if self.kind == "distributed":
            if int(v[-1]) > self.max_weight():
                raise BadVector(f"the weight element is above the largest {self.max_weight():g}")
            return
        if int(v[: self.keep].max(initial=0)) > self.quant.levels:
            raise BadVector(f"values above {self.quant.levels} levels")
        top = (1 << self.weight_digit_bits) - 1 if self.weight_digit_bits else self.quant.levels
        if int(v[self.keep :].max(initial=0)) > top:
            raise BadVector(f"a weight element above {top}")

    def decode_sum(
        self, ring_sum: RingVector, members: int
    ) -> tuple[npt.NDArray[np.float64], float]:
        """The ring sum of ``members`` encodings back to (Σ w·Δ over d coordinates, Σ w).

        Raises:
            QuantizationError: a ring sum of the wrong length, or more members than the
                ring holds.
        """
        total, weight, _ = self._decode(ring_sum, members, count=False)
        return total, weight

    def decode_counted(
        self,
        ring_sum: RingVector,
        members: int,
        work: npt.NDArray[np.float64] | None = None,
    ) -> tuple[npt.NDArray[np.float64], float, int]:
        """:meth:`decode_sum` and :meth:`edge_count` of one ring sum, from one pass
        over it (the aggregator's, as it closes a round).

        Args:
            ring_sum: the sum; where it lies in ``work`` (:meth:`decode_space`) it is
                spent by the decode (overwritten, then zeros).
            members: how many encodings it sums.
            work: the float64 vector of :meth:`decode_space` to decode in; None: one of
                the decode's own.

        Raises:
            QuantizationError: see :meth:`decode_sum`, or a ``work`` that is not
                :meth:`decode_space`'s.
        """
        return self._decode(ring_sum, members, count=True, work=work)

    def decode_space(self) -> tuple[npt.NDArray[np.float64], RingVector] | None:
        """Room to unmask and decode one ring sum in: a zeroed float64 vector of
        :attr:`padded` coordinates for :meth:`decode_counted`'s ``work``, and a zeroed
        ring vector of :attr:`length` elements in its last bytes for the sum.

        The decode fills the work vector a run of coordinates at a time, ascending: it
        reads a run's sums, then writes the run's coordinates (zeros where the run
        overlays the sum, the kept ones' values).  A run's coordinates take 8 bytes each
        where its sums took at most 2, so no run reaches the sums not yet read
        (:data:`fedsec.protocol.decode_space.MIN_RUN`).  The sum then costs no memory
        beside the decode's vector, which is the round's peak (at 11M parameters the sum
        is 19 MiB beside 128 MiB; at 50M, 86 beside 512).

        Returns None where the decode needs no such vector (the plain and distributed
        kinds, no rotation) or the ring's elements are wider than 2 bytes.
        """
        if self.kind != "compressed" or self.rotation_seed is None:
            return None
        offset = decode_space.sum_offset(self.padded, self.length, self.quant.dtype.itemsize)
        if offset is None:
            return None
        space = decode_space.zeroed(8 * self.padded)
        work = np.frombuffer(space, dtype=np.float64)
        ring: RingVector = np.frombuffer(
            space, dtype=self.quant.dtype, count=self.length, offset=offset
        )
        return work, ring

    def decode_one(self, vector: RingVector) -> tuple[npt.NDArray[np.float64], float]:
        """One member's input back to (w·Δ, w), e.g. for a trusted-mode rule or an audit.

        Raises:
            QuantizationError: see :meth:`decode_sum`.
        """
        return self.decode_sum(vector, 1)

    def add_one(self, vector: RingVector, total: npt.NDArray[np.float64]) -> float:
        """``total`` += w·Δ of one member's input, bit for bit ``total += decode_one(
        vector)[0]``; returns w.  The plain kind decodes and adds :data:`DECODE_BLOCK`
        coordinates at a time, so an upload costs no float64 copy of the update; the
        others decode whole first (their rotation mixes every coordinate).

        Raises:
            QuantizationError: see :meth:`decode_sum` (``total`` is then unchanged).
        """
        values = np.asarray(vector).reshape(-1)
        if self.kind != "plain":
            update, weight = self.decode_one(values)
            total += update
            return weight
        if values.size != self.length:
            raise QuantizationError(
                f"a ring sum of this round has {self.length} elements, got {values.size}"
            )
        weight = dequantize_sum(values[-1:], 1, self.quant)[1]
        for a in range(0, self.dim, DECODE_BLOCK):
            b = min(a + DECODE_BLOCK, self.dim)
            total[a:b] += dequantize_run(values[a:b], 1, self.quant)
        return weight

    def check_packed(self, raw: bytes) -> None:
        """:meth:`check_input` of one member's wire vector (packed at the ring's width,
        already checked by :func:`~fedsec.crypto.quantize.check_packed`), read
        :data:`DECODE_BLOCK` elements at a time: no unpacked copy of it (plain kind; the
        others unpack it whole).

        Raises:
            BadVector: as :meth:`check_input`.
        """
        m = self.quant.ring_bits
        if self.kind != "plain":
            self.check_input(unpack(raw, self.length, m))
            return
        levels, weight = self.quant.levels, 0
        for start, run in unpack_runs(raw, self.length, m, DECODE_BLOCK):
            body = run[: max(0, self.dim - start)]
            if int(body.max(initial=0)) > levels:
                raise BadVector(f"values above {levels} levels")
            if start + run.size > self.dim:
                weight = int(run[-1])
        if weight > levels:
            raise BadVector(f"a weight element above {levels}")

    def add_packed(self, raw: bytes, total: npt.NDArray[np.float64]) -> float:
        """:meth:`add_one` of one member's wire vector, checked by :meth:`check_packed`:
        bit for bit ``add_one(unpack(raw))``, read :data:`DECODE_BLOCK` elements at a
        time in the plain kind; returns w.

        Raises:
            BadVector: as :func:`~fedsec.crypto.quantize.unpack` (``total`` unchanged).
        """
        m = self.quant.ring_bits
        if self.kind != "plain":
            return self.add_one(unpack(raw, self.length, m), total)
        weight = 0.0
        for start, run in unpack_runs(raw, self.length, m, DECODE_BLOCK):
            end = min(start + run.size, self.dim)
            if end > start:
                total[start:end] += dequantize_run(run[: end - start], 1, self.quant)
            if start + run.size > self.dim:
                weight = dequantize_sum(run[-1:], 1, self.quant)[1]
        return weight

    def edge_count(self, ring_sum: RingVector, members: int) -> int:
        """Coordinates of the ring sum of ``members`` inputs near the edge of the ring,
        likely wraps; 0 for kinds that never wrap.

        Distributed kind: within 1/k of the ring's half range of either edge.  A
        coordinate that wrapped by less than one worst-case standard deviation lands
        there, so this counts every likely wrap (and, rarely, a value that came close
        without wrapping).  Wrapping compressed kind: the centred sum within
        :data:`WRAP_EDGE_FRACTION` of the half range of either edge (an upper estimate:
        sums that came close without wrapping count too).  The count is
        :meth:`decode_counted`'s, so it decodes the sum too; a caller that needs both
        takes them from there.

        Raises:
            QuantizationError: see :meth:`decode_sum`.
        """
        return self._decode(ring_sum, members, count=True)[2]

    def _decode(
        self,
        ring_sum: RingVector,
        members: int,
        count: bool,
        block: int = DECODE_BLOCK,
        work: npt.NDArray[np.float64] | None = None,
    ) -> tuple[npt.NDArray[np.float64], float, int]:
        """(Σ w·Δ, Σ w, and with ``count`` the edge count, else 0), decoded ``block``
        coordinates at a time straight into the one float64 vector that is unrotated in
        place: every step before the rotation is per coordinate, so the result is the
        whole-vector decode's, bit for bit."""
        values = np.asarray(ring_sum).reshape(-1)
        if values.size != self.length:
            raise QuantizationError(
                f"a ring sum of this round has {self.length} elements, got {values.size}"
            )
        if self.kind == "plain":
            total = np.empty(self.dim, dtype=np.float64)
            for a in range(0, self.dim, block):
                b = min(a + block, self.dim)
                dequantize_run(values[a:b], members, self.quant, out=total[a:b])
            # the weight's element alone: dequantize_sum checks the member count first
            return total, dequantize_sum(values[-1:], members, self.quant)[1], 0
        if self.kind == "distributed":
            return self._decode_distributed(values, count, block)
        return self._decode_compressed(values, members, count, block, work)

    def _decode_distributed(
        self, values: RingVector, count: bool, block: int
    ) -> tuple[npt.NDArray[np.float64], float, int]:
        assert self.ddp is not None and self.rotation_seed is not None
        m, n = self.quant.ring_bits, self.keep
        work = np.empty(n, dtype=np.float64)
        prescale = 1.0 / math.sqrt(n)  # unrotate's own factor at scale 1
        edges = 0
        for a in range(0, n, block):
            b = min(a + block, n)
            centred = recentre(values[a:b], m)
            edges += self._count_edges(centred) if count else 0
            run = work[a:b]
            np.multiply(centred, 1.0 / self.ddp.scale, out=run)
            run *= prescale
        weight = float(recentre(values[-1:], m)[0])
        return self._unrotated(work), weight, edges

    def _decode_compressed(
        self,
        values: RingVector,
        members: int,
        count: bool,
        block: int,
        work: npt.NDArray[np.float64] | None,
    ) -> tuple[npt.NDArray[np.float64], float, int]:
        """Each run of kept sums goes straight to its coordinates in the rotated frame,
        times the rescale (and the rotation's 1/√N, as :func:`~fedsec.crypto.rotation.
        unrotate` would multiply them).  The weight is read first and each run's sums
        before its coordinates are written, the order :meth:`decode_space` relies on."""
        overlaid = self.padded  # the first coordinate whose bytes may hold the sum
        if work is None:
            work = np.zeros(self.padded, dtype=np.float64)
        else:
            offset = decode_space.sum_offset(self.padded, self.length, self.quant.dtype.itemsize)
            if (
                work.shape != (self.padded,)
                or decode_space.space_of(work) is None
                or offset is None
            ):
                raise QuantizationError(
                    f"a decode's work vector is decode_space()'s {self.padded} float64 values"
                )
            overlaid = offset // 8
            block = max(decode_space.MIN_RUN, 1 << (block - 1).bit_length())
        if self.wraps:
            weight = self._centred_weight(values, members)
        else:
            weight = dequantize_sum(values[self.keep :], members, self._range_quant())[1]
        factor = self.rescale
        if self.rotation_seed is not None:
            factor /= math.sqrt(self.padded)
        multiply = factor != 1.0 or self.rotation_seed is not None
        edges, used, quant = 0, 0, self._range_quant()
        for start, kept in kept_runs(self.subset_seed, self.padded, self.keep, block):
            run = values[used : used + kept.size]
            used += kept.size
            if self.wraps:
                twice = self._twice_centred(run, members)
                edges += self._count_edges(twice) if count else 0
                sums = twice.astype(np.float64) * (self.range / self.quant.levels)
            else:
                sums = dequantize_run(run, members, quant)
            if multiply:
                sums *= factor
            if start + block > overlaid:  # the sum's bytes: every coordinate is written
                work[start : start + block] = 0.0
            work[start + kept] = sums
        if self.rotation_seed is None:
            return work, weight, edges
        return self._unrotated(work), weight, edges

    def _unrotated(self, work: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``work`` (N prescaled coordinates) unrotated in place to its first d, the rest
        of it given back: to the allocator (a vector of its own), or its pages to the
        system (:func:`fedsec.protocol.decode_space.release_after`)."""
        assert self.rotation_seed is not None
        rotation.unrotate_prescaled(work, self.rotation_seed, self.dim)
        if decode_space.space_of(work) is None:
            work.resize(self.dim, refcheck=False)  # no view of work exists: nothing dangles
            return work
        return decode_space.release_after(work, self.dim)

    def _count_edges(self, centred: npt.NDArray[np.int64]) -> int:
        """How many of a may-wrap kind's centred sums lie in the ring's edge region: in
        ring units (distributed) or half levels (:meth:`_twice_centred`)."""
        half = 1 << (self.quant.ring_bits - 1)
        if self.ddp is not None:
            edge = half * (1.0 - 1.0 / self.ddp.wrap_stddevs)
        else:
            edge = 2 * half * (1.0 - WRAP_EDGE_FRACTION)
        return int(np.count_nonzero(np.abs(centred) > edge))

    def _twice_centred(self, body: RingVector, members: int) -> npt.NDArray[np.int64]:
        """Twice the centred sums Σ(v − L/2) of ``members`` inputs, as the ring shows
        them: in [−2^m, 2^m), exact unless the true sum left ± half the ring."""
        m = self.quant.ring_bits
        seen = np.asarray(body).astype(np.int64) & ((1 << m) - 1)
        twice = (2 * seen - members * self.quant.levels) & ((2 << m) - 1)
        twice[twice >= (1 << m)] -= 2 << m
        return twice

    def _decode_centred(
        self, values: RingVector, members: int, twice: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.float64], float]:
        """The wrapping codec's ring sum back to (the kept coordinates' sums in update
        units, Σ w), before scattering; ``twice``: :meth:`_twice_centred` of it, where
        the caller has it already.

        Raises:
            QuantizationError: more members than the cohort whose weights the ring holds.
        """
        weight = self._centred_weight(values, members)
        if twice is None:
            twice = self._twice_centred(values[: self.keep], members)
        # a level is 2s/L wide, so half a level (one unit of ``twice``) is s/L
        total = twice.astype(np.float64) * (self.range / self.quant.levels)
        return total, weight

    def _centred_weight(self, values: RingVector, members: int) -> float:
        """Σ w of the wrapping codec's ring sum, from its weight digits.

        Raises:
            QuantizationError: more members than the cohort whose weights the ring holds.
        """
        if not 1 <= members <= self.cohort:
            raise QuantizationError(
                f"{members} members: this round's ring holds the sums of 1..{self.cohort}"
            )
        digits = np.asarray(values[self.keep :]).astype(np.int64) & self.quant.ring_mask
        q = self.weight_digit_bits
        return sum(int(v) << (q * j) for j, v in enumerate(digits)) / self.quant.levels

    def _weight_digits(self, weight: int) -> list[int]:
        """The weight's element(s): itself, or its base-2^q digits, least significant first."""
        q = self.weight_digit_bits
        if not q:
            return [weight]
        return [(weight >> (q * j)) & ((1 << q) - 1) for j in range(self.weight_elements)]

    def _range_quant(self) -> QuantSpec:
        return QuantSpec(self.quant.bits, self.range, self.quant.ring_bits)

    def _scatter(self, kept: npt.NDArray[np.float64], factor: float) -> npt.NDArray[np.float64]:
        """Kept coordinates back to d coordinates: into the rotated frame, × ``factor``
        (folded into the inverse rotation's own pass where there is one), unrotated."""
        idx = self.subset()
        full = np.asarray(kept, dtype=np.float64)
        if idx is not None:
            full = np.zeros(self.padded, dtype=np.float64)
            full[idx] = kept
        if self.rotation_seed is not None:
            return rotation.unrotate(full, self.rotation_seed, self.dim, scale=factor)
        return full * factor if factor != 1.0 else full


def _round_weight(value: float, seed: bytes) -> int:
    """``value`` rounded stochastically to an integer (unbiased)."""
    low = math.floor(value)
    u = float(prg.uniform01(seed, _WEIGHT_DOMAIN, 1)[0])
    return low + (1 if u < value - low else 0)
