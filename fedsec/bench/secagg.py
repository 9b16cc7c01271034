"""One full SecAgg+ round in one process: exactness, time per side, bytes, memory.

Members are driven one after another so memory stays O(d) per member: each
member's masked input goes straight into the server's running sum, and only a
plain int64 sum of the quantized inputs is kept to check exactness.

Drop-out stages (``--dropout-stage``): ``advertise`` = lost before advertising
keys; ``share`` = advertised, lost before sending shares; ``masked`` = lost after
share keys, before the masked input (the default, the costly case for the
server, which must remove the dropped members' pairwise masks); ``unmask`` = sent
its input and signed the survivor sets (the consistency stage), lost before answering
unmask.

``server_s`` is the server's side replayed on a fresh session fed the same messages
(its steady state: the first round of a process also loads its compiled loops, reported
as ``server_first_s``); each of five replays is paired with a floor measured right
after it, and the pair with the median ratio is reported.
``floor_s`` is measured in the same run with the same primitives: expanding every
mask the server had to remove (one self mask per survivor, one pairwise mask per
survivor-dropped edge) into a reused buffer and subtracting it, and adding up as many
distinct vectors as there are survivors, in the ring's dtype.  It is what any server
doing this work must spend, so ``server_s / floor_s`` is the overhead of everything
else (signatures, Shamir, key agreement, and adding a ring narrower than its dtype),
robust to a noisy machine.  ``client_floor_s`` is
the same for a member, measured right after each member's masked input and the median
taken: drawing its rounding words (4 bytes a coordinate) and its self and pairwise
masks, and adding the masks; ``client_s / client_floor_s`` is what quantizing, sharing
keys and packing cost on top.

``ddp_noise`` > 0: members discretise for distributed DP instead of quantizing
(:func:`fedsec.crypto.discretize.encode`: rotation, scaling, conditional rounding and a
Skellam noise share of noise multiplier ``ddp_noise``, sized for the survivors), in the
same ring; the vector is the rotated length (d padded to a power of two).  Compare its
``client_s`` with a run without it: the cost of the noise on the member's side.  On a
busy machine two runs differ by more than that cost, so the run also times
:func:`~fedsec.crypto.quantize.quantize` on every member's same vector (outside the
member's time) and reports ``ddp_member_ratio``: the median over members of their time
over that time with ``encode`` replaced by ``quantize``, both measured in this run.

``ring_bits`` > 0 runs the round in a ring wider than its cohort needs: the ring a
larger cohort would use (up to 32 bits and beyond), whose server and member work per
member is what the ring's width decides, without simulating that many members.

Codec options (``rotation``, ``keep``, ``range_stddevs``): members encode with the
round's :func:`~fedsec.protocol.codec_choice.codec_for` codec (shared Hadamard rotation,
shared random subset, rounding over a shared range), as an agent does; the aggregator's
decode of the unmasked sum is timed too (``codec_decode_s``), and ``codec_subset_s`` is
deriving the round's subset once (each member and the aggregator pay it once a round).
Bytes: ``bytes_up_per_client`` is everything a surviving member uploads in the round's
messages (keys, signature, encrypted shares, masked vector, the consistency signature,
unmask shares) as binary fields; HTTP request heads come on top (about 4 KB a round,
measured by ``fedsec simulate``).  Both ratios are against float32 (4·d bytes).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from fedsec.bench.common import with_environment
from fedsec.crypto import prg
from fedsec.crypto.discretize import DdpSpec, decode_sum, encode
from fedsec.crypto.errors import ProtocolError
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec, dequantize_sum, quantize
from fedsec.crypto.secagg import ClientSession, SecAggParams, ServerSession, default_neighbors
from fedsec.crypto.secagg.server import SHARE_CIPHERTEXT_BYTES, RoundResult
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ring_width import ring_bits_for
from fedsec.protocol.stages import SECAGG_STAGES

STAGES = ("advertise", "share", "masked", "unmask")
F = TypeVar("F", bound=Callable[..., Any])


class _Timer:
    def __init__(self) -> None:
        self.stages: dict[str, float] = defaultdict(float)
        # (stage, method name, arguments) of every call, for replaying a server
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []

    def run(self, stage: str, fn: Any, *args: Any) -> Any:
        self.calls.append((stage, fn.__name__, args))
        start = time.perf_counter()
        out = fn(*args)
        self.stages[stage] += time.perf_counter() - start
        return out

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def _without_gc(fn: F) -> F:
    """Run ``fn`` with the cyclic garbage collector off, after a collection (as timeit
    does): the previous round's 100 sessions were collected inside the next round's
    timed stages, a pause of 150-350 ms in the second round of every --repeat run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return cast(F, wrapper)


@_without_gc
def run_secagg(
    clients: int,
    dim: int,
    dropout: float,
    dropout_stage: str = "masked",
    neighbors: int = 0,
    threshold: int = 0,
    bits: int = 8,
    clip: float = 1.0,
    seed: int = 0,
    ddp_noise: float = 0.0,
    rotation: str = "none",
    keep: float = 1.0,
    range_stddevs: float = 0.0,
    headroom_bits: int = 0,
    ring_bits: int = 0,
) -> dict[str, Any]:
    """Run one round and return the result record (see module docstring).

    Raises:
        ValueError: an unknown drop-out stage, distributed noise with codec options, or
            a ``ring_bits`` narrower than the round's ring.
        ProtocolError: codec options the round spec refuses (see ``codec_for``).
    """
    if dropout_stage not in STAGES:
        raise ValueError(f"dropout stage must be one of {STAGES}")
    codec_spec = wire.CodecSpec(
        rotation=rotation,  # type: ignore[arg-type]
        keep=keep,
        range_stddevs=range_stddevs,
        headroom_bits=headroom_bits,
    )
    compressed = codec_spec.compresses
    if compressed and ddp_noise > 0:
        raise ValueError("distributed noise discretises on its own terms: no codec options")
    if neighbors == 0:
        neighbors, auto_t = default_neighbors(clients)
        threshold = threshold or auto_t
    threshold = threshold or neighbors // 2 + 1
    rng = np.random.default_rng(seed)  # test data only, never masks
    members = [f"m{i:05d}" for i in range(clients)]
    identities = {m: SigningIdentity.generate() for m in members}
    roster = {m: ident.public_bytes for m, ident in identities.items()}
    rule_bits = ring_bits_for(bits, clients, headroom_bits)
    # a wider ring than the cohort needs: the ring a larger cohort would use, timed
    # without its members (the server's work per member depends on the ring, not on n)
    if ring_bits and ring_bits < rule_bits:
        raise ValueError(f"ring bits must be at least {rule_bits} here, got {ring_bits}")
    ring_bits = ring_bits or rule_bits
    spec = QuantSpec(bits, clip, ring_bits)
    n_drop = round(dropout * clients)
    ddp = None
    if ddp_noise > 0:
        ddp = DdpSpec(dim, ring_bits, clip, clip, ddp_noise, clients - n_drop, clients)
    shared = os.urandom(32)  # the round's rotation (from the signed spec in a round)
    codec = codec_for(codec_round_spec(members, spec, dim, codec_spec)) if compressed else None
    subset_s = None
    if codec is not None:
        start = time.perf_counter()
        codec.subset()  # derived once a round, then cached
        subset_s = time.perf_counter() - start
    # a distributed-DP vector is the rotated length, with no weight coordinate
    vector_dim = ddp.padded - 1 if ddp else codec.length - 1 if codec else dim
    params = SecAggParams(
        "bench",
        1,
        tuple(members),
        neighbors,
        threshold,
        spec,
        vector_dim,
        os.urandom(32),
        wraps=headroom_bits > 0,
    )
    dropped = set(rng.choice(members, size=n_drop, replace=False).tolist()) if n_drop else set()

    server = ServerSession(params, roster)
    st = _Timer()
    ct: dict[str, _Timer] = {m: _Timer() for m in members}
    sessions = {m: ClientSession(params, m, identities[m], roster) for m in members}

    def active(stage: str) -> list[str]:
        cut = STAGES.index(dropout_stage)
        return [m for m in members if m not in dropped or STAGES.index(stage) < cut]

    for m in active("advertise"):
        msg = ct[m].run("advertise", sessions[m].advertise)
        st.run("advertise", server.receive_advertise, msg)
    key_list = st.run("advertise", server.close_advertise)
    live = set(server.live)
    share_bytes = []
    up: dict[str, int] = defaultdict(int)  # member -> bytes of its uploads
    for m in active("advertise"):
        up[m] += _ADVERTISE_BYTES
    for m in active("share"):
        if m not in live:
            continue
        msg = ct[m].run("share_keys", sessions[m].share_keys, key_list)
        share_bytes.append(sum(len(s.ciphertext) for s in msg.shares))
        up[m] += sum(len(s.recipient) + len(s.ciphertext) for s in msg.shares)
        st.run("share_keys", server.receive_share_keys, msg)
    relays = st.run("share_keys", server.close_share_keys)
    for m, relay in relays.items():
        ct[m].run("share_keys", sessions[m].receive_shares, relay)

    encode_s: dict[str, float] = {}
    quantize_s: dict[str, float] = {}
    plain = np.zeros(params.vector_length, dtype=np.int64)
    exact_float = np.zeros(dim, dtype=np.float64)
    vector_bytes = 0
    client_floors: list[float] = []
    for m in active("masked"):
        if m not in relays:
            continue
        delta = rng.standard_normal(dim).astype(np.float32) * np.float32(clip / math.sqrt(dim))
        weight = 1.0
        if ddp is not None:
            start = time.perf_counter()
            q = ct[m].run(
                "masked_input", lambda d: encode(d, ddp, shared, os.urandom(32)).ring, delta
            )
            encode_s[m] = time.perf_counter() - start
            # the noiseless path's cost for the same vector, outside the member's time
            start = time.perf_counter()
            quantize(delta, weight, spec, os.urandom(32))
            quantize_s[m] = time.perf_counter() - start
        elif codec is not None:
            start = time.perf_counter()
            q = ct[m].run(
                "masked_input", lambda d, w=weight: codec.encode(d, w, os.urandom(32)).ring, delta
            )
            encode_s[m] = time.perf_counter() - start
        else:
            q = ct[m].run("masked_input", quantize, delta, weight, spec, os.urandom(32))
        msg = ct[m].run("masked_input", sessions[m].masked_input, q)
        # the member's floor, right after its own work (outside every timer): on a busy
        # machine floor and member then see the same load
        peers = len(server.graph.live_neighbors(m, server.participants))
        client_floors.append(_client_floor(params, peers))
        vector_bytes = len(msg.vector)
        up[m] += vector_bytes
        st.run("masked_input", server.receive_masked_input, msg)
        plain += q
        norm = float(np.linalg.norm(delta.astype(np.float64)))
        exact_float += delta * (min(1.0, clip / norm) if norm > 0 else 1.0) * weight
    request = st.run("masked_input", server.close_masked_input)
    # every survivor signs the survivor sets, those lost at "unmask" too (they left after)
    for m in request.survivors:
        signature = ct[m].run("consistency", sessions[m].sign_survivors, request)
        up[m] += len(signature.signature)
        st.run("consistency", server.receive_consistency, signature)
    proofs = st.run("consistency", server.close_consistency)
    responders = [m for m in proofs if m in active("unmask")]
    refused = 0
    for m in responders:
        try:
            msg = ct[m].run("unmask", sessions[m].unmask, proofs[m])
        except ProtocolError:
            # fewer than t of its neighbours signed (they dropped): it reveals nothing,
            # as a member would, and the round completes if the others' shares suffice
            refused += 1
            continue
        up[m] += sum(len(who) + len(share) for who, share in msg.seed_shares + msg.key_shares)
        st.run("unmask", server.receive_unmask, msg)
    result = st.run("unmask", server.finalize)

    survivors = set(result.survivors)
    plain_ring = plain & spec.ring_mask
    exact = bool(np.array_equal(result.ring_sum.astype(np.int64), plain_ring))
    noise_std = ddp_ratio = decode_s = decode_first_s = relative_error = None
    if codec is not None:
        # the first decode in a process also faults in its buffers; an aggregator decodes
        # every round, so the median of three is its steady state (the first is reported)
        decode_runs = []
        for _ in range(3):
            start = time.perf_counter()
            total, _ = codec.decode_sum(result.ring_sum, len(survivors))
            decode_runs.append(time.perf_counter() - start)
        decode_first_s, decode_s = decode_runs[0], statistics.median(decode_runs)
        # a shared subset makes the estimate unbiased, not close: ‖error‖ / ‖exact sum‖
        error = total - exact_float
        max_abs_err = float(np.max(np.abs(error)))
        relative_error = float(np.linalg.norm(error) / np.linalg.norm(exact_float))
    elif ddp is not None:
        ddp_ratio = statistics.median(
            ct[m].total / (ct[m].total - encode_s[m] + quantize_s[m]) for m in survivors
        )
        # the error is the noise: report its measured standard deviation
        error = decode_sum(result.ring_sum, ddp, shared) - exact_float
        max_abs_err = float(np.max(np.abs(error)))
        noise_std = {"measured": float(error.std()), "target": ddp.noise_stddev(len(survivors))}
    else:
        weighted, weights = dequantize_sum(result.ring_sum, len(survivors), spec)
        mean = weighted / weights
        max_abs_err = float(np.max(np.abs(mean - exact_float / len(survivors))))

    # the server's steady state against its floor, each replay paired with a floor
    # measured right after it: one measurement of each moved with the machine's load by
    # more than the overhead it is there to show
    edges = _dropped_edges(server, result.dropped)
    pairs = []
    for _ in range(_SERVER_REPLAYS):
        replay = _replay_server(params, roster, st, result.ring_sum)
        pairs.append((replay, _floor(params, len(survivors), edges)))
    pairs.sort(key=lambda pair: pair[0].total / pair[1])
    server_t, floor_s = pairs[len(pairs) // 2]
    client_totals = [ct[m].total for m in survivors]
    client_s = statistics.median(client_totals)
    client_floor_s = statistics.median(client_floors)
    client_stage = {
        stage: round(statistics.median(ct[m].stages.get(stage, 0.0) for m in survivors), 6)
        for stage in SECAGG_STAGES
    }
    return with_environment(
        {
            "bench": "secagg",
            "clients": clients,
            "dim": dim,
            "neighbors": neighbors,
            "threshold": threshold,
            "bits": bits,
            "ring_bits": ring_bits,
            "dropout": dropout,
            "dropout_stage": dropout_stage,
            "dropped": len(result.dropped),
            "refused_unmask": refused,
            "survivors": len(survivors),
            "exact": exact,
            "max_abs_err": max_abs_err,
            "quant_step": spec.step(),
            "ddp_noise": ddp_noise,
            "ddp_noise_std": noise_std,
            "ddp_encode_s": _median_of(encode_s, survivors) if ddp else None,
            "ddp_quantize_s": _median_of(quantize_s, survivors),
            "ddp_member_ratio": round(ddp_ratio, 3) if ddp_ratio is not None else None,
            "client_s": round(client_s, 6),
            "client_floor_s": round(client_floor_s, 6),
            "client_over_floor": round(client_s / client_floor_s, 3) if client_floor_s else None,
            "client_stage_s": client_stage,
            "server_s": round(server_t.total, 6),
            "server_stage_s": {k: round(v, 6) for k, v in server_t.stages.items()},
            "server_first_s": round(st.total, 6),
            "floor_s": round(floor_s, 6),
            "server_over_floor": round(server_t.total / floor_s, 3) if floor_s else None,
            "rotation": rotation,
            "keep": keep,
            "range_stddevs": range_stddevs,
            "headroom_bits": headroom_bits,
            "codec_subset_s": round(subset_s, 6) if subset_s is not None else None,
            "codec_encode_s": _median_of(encode_s, survivors) if codec else None,
            "codec_decode_s": round(decode_s, 6) if decode_s is not None else None,
            "codec_decode_first_s": (
                round(decode_first_s, 6) if decode_first_s is not None else None
            ),
            "codec_relative_error": relative_error,
            "bytes_per_param": round(vector_bytes / dim, 6),
            "payload_compression_ratio": round(4 * dim / vector_bytes, 3),
            "bytes_up_per_client": int(statistics.median(up[m] for m in survivors)),
            "compression_ratio": round(4 * dim / statistics.median(up[m] for m in survivors), 3),
            "share_bytes_per_client": (int(statistics.median(share_bytes)) if share_bytes else 0),
            "share_ciphertext_bytes": SHARE_CIPHERTEXT_BYTES,
        }
    )


# An advertisement's binary fields: two X25519 public keys and an Ed25519 signature.
_ADVERTISE_BYTES = 32 + 32 + 64


def codec_round_spec(
    members: list[str],
    quant: QuantSpec,
    dim: int,
    codec: wire.CodecSpec,
    seed: bytes | None = None,
) -> wire.RoundSpec:
    """The fields of a round spec that decide its codec (unsigned: nothing here is
    verified, and the codec depends on no signature); ``seed`` (32 bytes) is the
    attempt's seed, random if None."""
    return wire.RoundSpec(
        federation_id="bench",
        round=1,
        attempt=1,
        secure_sum="secagg",
        model_version=1,
        model_sha256="00" * 32,
        task="bench",
        task_version="1",
        schema_fingerprint="",
        cohort=members,
        neighbors=0,
        threshold=0,
        quant_bits=quant.bits,
        ring_bits=quant.ring_bits,
        clip_norm=quant.clip,
        dim=dim,
        seed=(seed if seed is not None else os.urandom(32)).hex(),
        max_weight_samples=1,
        weight_caps={},
        training=wire.TrainingSpec(local_epochs=1, batch_size=1, lr=0.0, optimizer="sgd"),
        dp=wire.DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=0.0, delta=0.0),
        deadlines={},
        codec=codec,
    )


def _median_of(seconds: dict[str, float], members: set[str]) -> float | None:
    return round(statistics.median(seconds[m] for m in members), 6) if seconds else None


def _dropped_edges(server: ServerSession, dropped: tuple[str, ...]) -> int:
    return sum(len(server.graph.live_neighbors(m, server.survivors)) for m in dropped)


# Server replays paired with a floor each; the pair with the median ratio is reported.
_SERVER_REPLAYS = 5


def _replay_server(
    params: SecAggParams, roster: Any, live: _Timer, expected: npt.NDArray[Any]
) -> _Timer:
    """The server's side of the round again, on a fresh session fed the same messages
    in the same order: a process's steady state (its compiled loops loaded by the round
    before), timed per stage.

    Raises:
        RuntimeError: the replay's sum differs from the round's.
    """
    server = ServerSession(params, roster)
    timer = _Timer()
    result = None
    for stage, name, args in live.calls:
        result = timer.run(stage, getattr(server, name), *args)
    if not isinstance(result, RoundResult) or not np.array_equal(result.ring_sum, expected):
        raise RuntimeError("the server's replay did not give the round's sum")
    return timer


def _floor(params: SecAggParams, survivors: int, dropped_edges: int) -> float:
    """PRG output the server had to generate and subtract, plus adding up the
    survivors' vectors."""
    dtype = params.quant.dtype
    acc = np.zeros(params.vector_length, dtype=dtype)
    mask = np.empty(params.vector_length, dtype=dtype)
    # one vector per survivor, as the server reads: the same vector added again and
    # again stays in cache, a cost no server receiving distinct vectors can reach
    vectors = [
        prg.expand(os.urandom(32), b"floor/vector", params.vector_length, dtype)
        for _ in range(survivors)
    ]
    start = time.perf_counter()
    for vector in vectors:
        np.add(acc, vector, out=acc)
    for i in range(survivors + dropped_edges):
        prg.expand_into(os.urandom(32), b"floor/%d" % i, mask)
        np.subtract(acc, mask, out=acc)
    return time.perf_counter() - start


def _client_floor(params: SecAggParams, neighbours: int) -> float:
    """A member's PRG output: its rounding words and its 1 + ``neighbours`` masks,
    each mask added to its vector."""
    dtype = params.quant.dtype
    acc = np.zeros(params.vector_length, dtype=dtype)
    mask = np.empty(params.vector_length, dtype=dtype)
    words = np.empty(params.vector_length, dtype="<u4")
    start = time.perf_counter()
    prg.expand_into(os.urandom(32), b"floor/rounding", words)
    for i in range(1 + neighbours):
        prg.expand_into(os.urandom(32), b"floor/%d" % i, mask)
        np.add(acc, mask, out=acc)
    return time.perf_counter() - start
