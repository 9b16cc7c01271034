"""``fedsec bench model-size``: SecAgg+ rounds at the model sizes users train (1M, 11M =
ResNet-18 with GroupNorm, 50M parameters), and fedsec's DP-SGD loop against a plain Opacus
loop on ResNet-18.

One row per size and member count. The round is SecAgg+ with 8-bit rounding, run with
the codec that keeps the upload near one byte a parameter: a shared Hadamard rotation,
one headroom bit (a 9-bit ring) and a shared random subset of ``KEEP`` · d coordinates
(9 · 0.9 / 8 = 1.01 bytes a parameter). Without the codec a 10-member 8-bit ring has
12 bits (1.5 bytes a parameter), and without the subset the rotation pads d to the next
power of two (11.2M -> 16.8M).

What is measured, and where:

- **members** (this process, one after another): each member's work besides training,
  ``member_overhead_s`` (the median over members): encoding its update (clip, rotate,
  keep, round), its SecAgg+ session (key advertisement, Shamir shares, masks, the
  consistency signature, unmask shares), the commitment and signed contribution
  statement, the RFC 9421 signature of the upload, and handing each message to the
  aggregator process (a pipe, standing in for loopback HTTP: the bytes are copied
  once, as a socket would). ``bytes_per_param`` is the masked vector over d; HTTP heads
  and the small control messages come on top (``bytes_up_per_member``).
- **aggregator** (a separate, freshly spawned process, so its peak is its own): it
  starts as ``fedsec aggregator serve`` does (the CLI's aggregator group and the
  replica it serves; not the task's Opacus check, whose verdict ``init`` recorded:
  :mod:`fedsec.task.dp_verdict`; ``aggregator_imports_opacus`` says whether Opacus was
  imported all the same), then the
  real :class:`~fedsec.summation.secagg.SecAggPlusSession` receives every message, each
  masked input is stored in a real SQLite state store as the aggregator's intake does,
  the stages close, the session finalizes (unmasking and the codec's decode), and the
  round is applied as :class:`~fedsec.aggregator.rounds.apply.ModelApplier` does: the
  parent model file read a tensor at a time into the model's own tensors,
  :func:`fedsec.derive.apply_mean`, the new version written a tensor at a time from them.
  ``aggregator_peak_rss_mb`` is that process's VmHWM, against the target 4·d·4 B + 400 MB.
  The HTTP server's request buffers are not in it: an aggregator reads at most
  ``server.max_concurrent_uploads`` (8) bodies at once, at most 8 · 1.01 · d bytes more.
- **DP loop** (``dp_loop_over_opacus``, one row): one epoch of
  :func:`fedsec.learning.training.train_dataset` (Opacus with fedsec's CSPRNG noise,
  Poisson sampling, the task loss) against a plain Opacus loop (``make_private`` with
  Poisson sampling, torch's noise) on the same ResNet-18 weights, the same 32x32
  records and batch size, in back-to-back pairs whose order alternates; the median of
  the pairs' ratios and their spread, and one step's noise time for each
  (:func:`dp_loop_ratio`).

A size that would not fit the machine (``--max-gib``) is skipped with the reason printed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import click
import msgspec
import numpy as np
import torch
from torch import nn

from fedsec.bench.common import with_environment
from fedsec.bench.secagg import codec_round_spec
from fedsec.crypto.commitment import CommitmentContext, commit
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec
from fedsec.crypto.secagg import ClientSession, default_neighbors
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ring_width import ring_bits_for

#: Rounding bits and headroom bits: a 9-bit ring, the issue's "SecAgg+ 8-bit" as
#: close as a sum of 10 to 40 members allows. 8-bit rounding with one headroom bit wraps
#: (10 members' rounded deviations sum to ~4 times the 9-bit ring's half-width: relative
#: error 0.96 of the mean, measured); 6 bits with 3 headroom bits do not wrap.
BITS = 6
HEADROOM_BITS = 3
#: Shared subset: 0.9 · d coordinates of 9 bits are 1.01 bytes a parameter.
KEEP = 0.9
#: Range of the shared rounding, in standard deviations of a clipped rotated coordinate
#: (what fedsec simulate uses when rotating).
RANGE_STDDEVS = 3.0
#: Parameters of each size's label; None: ResNet-18 with GroupNorm (10 classes).
SIZES: dict[str, int | None] = {"1M": 1_000_000, "11M": None, "50M": 50_000_000}
#: Bytes a member process and the aggregator hold per parameter at the peak, measured
#: at 11M (float64 update, rotated float32 copies, ring vectors; the decode's float64):
#: sizes whose estimate exceeds --max-gib are skipped.
_PEAK_BYTES_PER_PARAM = 60
#: Leading coordinates of the new model checked against the exact mean update.
_CHECKED = 4096


# -- models -----------------------------------------------------------------------------


class _Basic(nn.Module):
    """ResNet's basic block with GroupNorm (32 groups) in place of BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(32, cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(32, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.down(x))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (7x7 stem, max-pool, [2, 2, 2, 2] basic blocks of
    64-512 channels) with GroupNorm: 11,181,642 parameters for 10 classes."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.GroupNorm(32, 64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        layers: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Basic(cin, cout, stride), _Basic(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))
        return out


class _Vector(nn.Module):
    """A model that is one parameter vector of ``d`` entries: what the aggregator's
    storage and application see of any model of that size."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))


def _model(label: str) -> nn.Module:
    size = SIZES[label]
    return ResNet18() if size is None else _Vector(size)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- the aggregator process ---------------------------------------------------------------


def _peak_rss_mb() -> float:
    """This process's VmHWM (its own peak; ru_maxrss would carry a parent's over exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _aggregator(conn: Connection, spec_raw: bytes, roster: dict[str, bytes], label: str) -> None:
    """The aggregator's side of one round, driven by messages on ``conn``; answers each
    with what the members need next, and the result and peak memory at the end."""
    from fedsec.aggregator.rounds.apply import own_arrays
    from fedsec.aggregator.storage.sqlite.store import SqliteStateStore
    from fedsec.derive import apply_mean
    from fedsec.learning.optimizers import FedAvg
    from fedsec.modelfile import read_model, write_model
    from fedsec.summation.secagg import SecAggPlusSession

    spec = msgspec.msgpack.decode(spec_raw, type=wire.RoundSpec)
    model = _model(label)
    # what the process holds before the round is a serving aggregator's start-up: its
    # code (the CLI imports only the command's group; serve imports the replica) and
    # the served model. The task's Opacus check is not in it: init recorded its verdict
    # (fedsec.task.dp_verdict), which serving only compares.
    importlib.import_module("fedsec.aggregator.cli")
    importlib.import_module("fedsec.aggregator.replica")
    opacus_imported = "opacus" in sys.modules
    baseline = _peak_rss_mb()
    with tempfile.TemporaryDirectory(prefix="fedsec-model-size-") as tmp:
        store = SqliteStateStore(Path(tmp) / "state.db")
        parent_file = Path(tmp) / "v1.safetensors"
        with parent_file.open("wb") as out:  # as ModelStore.put streams it
            write_model(model.state_dict(), out)
        # the parent, as the previous round's close wrote it: the same write as the new
        # version's below, so its peak is reported apart from the inputs'
        phases: dict[str, float] = {"parent": _peak_rss_mb()}
        session = SecAggPlusSession(spec, roster)
        server = session.server
        started = time.perf_counter()
        while True:
            stage, message = conn.recv()
            if stage == "close":
                closes = {
                    "advertise": server.close_advertise,
                    "share_keys": server.close_share_keys,
                    "masked_input": server.close_masked_input,
                    "consistency": server.close_consistency,
                }
                conn.send(closes[message]())
                continue
            if stage == "finalize":
                break
            session.receive(stage, message)
            # every accepted message is stored as the intake stores it (SQLite's cached
            # INSERT then holds the last body bound until the next: a masked input's
            # only until the consistency stage's first signature)
            body = message.vector if stage == "masked_input" else msgspec.msgpack.encode(message)
            with store.transaction():
                store.messages.add(spec.round, spec.attempt, stage, message.member, body)
            conn.send(None)
        phases["inputs"] = _peak_rss_mb()
        result = session.finalize()
        phases["finalize"] = _peak_rss_mb()
        before = _head(model)  # the parent: the model was written from it
        # as ModelApplier reads it: ModelStore.read_arrays into the model's own tensors
        with parent_file.open("rb") as source:
            read_model(source, parent_file.stat().st_size, into=own_arrays(model))
        apply_mean(model, None, result.weighted_sum, result.weight_sum, FedAvg(1.0))
        with (Path(tmp) / "v2.safetensors").open("wb") as out:  # as ModelApplier does
            written = write_model(model.state_dict(), out)
        phases["apply"] = _peak_rss_mb()
        first = _head(model) - before
        seconds = time.perf_counter() - started
        store.close()
    conn.send(
        {
            "survivors": len(result.survivors),
            "weight_sum": result.weight_sum,
            "model_sha256": written,
            "opacus_imported": opacus_imported,
            "head": first.tolist(),
            "phases": phases,
            "peak_rss_mb": _peak_rss_mb(),
            "baseline_rss_mb": baseline,
            "server_s": seconds,
        }
    )


def _head(model: nn.Module) -> np.ndarray:
    """The first :data:`_CHECKED` parameters in the model's (the sum's) order."""
    parts, count = [], 0
    for p in model.parameters():
        parts.append(p.detach().reshape(-1)[: _CHECKED - count].double().numpy())
        count += len(parts[-1])
        if count >= _CHECKED:
            break
    return np.concatenate(parts)


# -- members ------------------------------------------------------------------------------


class _Member:
    """One member's sessions and clock; only its own work is timed."""

    def __init__(self, name: str, spec: wire.RoundSpec, roster: dict[str, bytes], key: Any):
        self.name = name
        self.identity = key
        self.session = ClientSession(spec.secagg_params(), name, key, roster)
        self.seconds = 0.0
        self.upload_bytes = 0

    def run(self, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - start
        return out


def _ask(conn: Connection, member: _Member | None, stage: str, message: Any) -> Any:
    """Hand ``message`` to the aggregator (the member's upload, timed as its work) and
    wait for its answer (the aggregator's work, not timed)."""
    if member is None:
        conn.send((stage, message))
    else:
        member.run(conn.send, (stage, message))
    return conn.recv()


def _round(label: str, members: int, seed: int) -> dict[str, Any]:
    """One SecAgg+ round of ``members`` at size ``label``; the row of the result."""
    d = _params(_model(label))
    names = [f"m{i:03d}" for i in range(members)]
    keys = {m: SigningIdentity.generate() for m in names}
    roster = {m: k.public_bytes for m, k in keys.items()}
    ring = ring_bits_for(BITS, members, HEADROOM_BITS)
    codec_spec = wire.CodecSpec(
        rotation="hadamard", keep=KEEP, range_stddevs=RANGE_STDDEVS, headroom_bits=HEADROOM_BITS
    )
    neighbors, threshold = default_neighbors(members)
    spec = msgspec.structs.replace(
        codec_round_spec(names, QuantSpec(BITS, 1.0, ring), d, codec_spec),
        neighbors=neighbors,
        threshold=threshold,
    )
    codec = codec_for(spec)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_aggregator, args=(theirs, msgspec.msgpack.encode(spec), roster, label)
    )
    process.start()
    theirs.close()  # the child's end: its exit then ends our reads with EOFError
    try:
        row = _drive(ours, spec, codec, names, keys, roster, d, seed)
        final = ours.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the aggregator process of size {label} with {members} members exited with "
            f"code {process.exitcode} before the round closed"
        ) from None
    finally:
        process.join(timeout=600)
    peak = final["peak_rss_mb"]
    expected = np.asarray(row.pop("exact_mean_head"))
    error = np.asarray(final["head"][: len(expected)]) - expected
    target = (4 * d * 4) / 2**20 + 400
    row.update(
        label=label,
        params=d,
        members=members,
        neighbors=neighbors,
        ring_bits=ring,
        survivors=final["survivors"],
        closed=final["survivors"] == members,
        aggregator_peak_rss_mb=round(peak, 1),
        aggregator_target_mb=round(target, 1),
        aggregator_baseline_rss_mb=round(final["baseline_rss_mb"], 1),
        aggregator_round_mb=round(peak - final["baseline_rss_mb"], 1),
        aggregator_round_target_mb=round((4 * d * 4) / 2**20, 1),
        aggregator_peak_after_mb={k: round(v, 1) for k, v in final["phases"].items()},
        aggregator_s=round(final["server_s"], 3),
        aggregator_imports_opacus=final["opacus_imported"],
        model_sha256=final["model_sha256"],
        # the new model's first coordinates against the exact mean update (FedAvg, lr 1,
        # from zeros): the codec's rounding and subset error, relative to the mean's norm
        mean_relative_error=round(float(np.linalg.norm(error) / np.linalg.norm(expected)), 4),
    )
    return row


def _drive(
    conn: Connection,
    spec: wire.RoundSpec,
    codec: Any,
    names: list[str],
    keys: dict[str, SigningIdentity],
    roster: dict[str, bytes],
    d: int,
    seed: int,
) -> dict[str, Any]:
    """The members' side of the round; their timings and bytes."""
    rng = np.random.default_rng(seed)  # test updates only, never masks
    members = {m: _Member(m, spec, roster, keys[m]) for m in names}
    for m in members.values():
        _ask(conn, m, "advertise", m.run(m.session.advertise))
        m.upload_bytes += 128  # two X25519 keys and a signature
    key_list = _ask(conn, None, "close", "advertise")
    for m in members.values():
        shares = m.run(m.session.share_keys, key_list)
        m.upload_bytes += sum(len(s.recipient) + len(s.ciphertext) for s in shares.shares)
        _ask(conn, m, "share_keys", shares)
    relays = _ask(conn, None, "close", "share_keys")
    vector_bytes = 0
    encode_s: list[float] = []
    exact = np.zeros(min(d, _CHECKED), dtype=np.float64)
    for m in members.values():
        m.run(m.session.receive_shares, relays[m.name])
        delta = (rng.standard_normal(d) / math.sqrt(d)).astype(np.float32)
        exact += delta[: len(exact)]  # norm ~1 = the clip: each update is kept whole
        start = time.perf_counter()
        encoded = m.run(codec.encode, delta, 1.0, os.urandom(32))
        encode_s.append(time.perf_counter() - start)
        masked = m.run(m.session.masked_input, encoded.ring)
        m.run(_statement, spec, m, encoded.ring, masked.vector)
        vector_bytes = len(masked.vector)
        m.upload_bytes += vector_bytes
        del delta, encoded
        _ask(conn, m, "masked_input", masked)
    request = _ask(conn, None, "close", "masked_input")
    for m in members.values():
        signature = m.run(m.session.sign_survivors, request)
        m.upload_bytes += len(signature.signature)
        _ask(conn, m, "consistency", signature)
    proofs = _ask(conn, None, "close", "consistency")
    for m in members.values():
        response = m.run(m.session.unmask, proofs[m.name])
        pairs = response.seed_shares + response.key_shares
        m.upload_bytes += sum(len(who) + len(share) for who, share in pairs)
        _ask(conn, m, "unmask", response)
    conn.send(("finalize", None))
    return {
        "member_overhead_s": round(statistics.median(m.seconds for m in members.values()), 3),
        "member_overhead_max_s": round(max(m.seconds for m in members.values()), 3),
        "member_encode_s": round(statistics.median(encode_s), 3),
        "bytes_per_param": round(vector_bytes / d, 4),
        "bytes_up_per_member": int(statistics.median(m.upload_bytes for m in members.values())),
        "exact_mean_head": (exact / len(names)).tolist(),
    }


def _statement(spec: wire.RoundSpec, member: _Member, ring: np.ndarray, vector: bytes) -> None:
    """The member's commitment, signed contribution statement and the RFC 9421 signature
    of the upload (its Content-Digest hashes the body), as the agent makes them."""
    context = CommitmentContext(
        spec.federation_id, spec.round, spec.attempt, member.name, spec.ring_bits
    )
    commitment = commit(ring, os.urandom(32), context)
    wire.ContributionStatement(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member.name,
        vector_sha256=hashlib.sha256(vector).hexdigest(),
        commitment=commitment.hex(),
    ).sign(member.identity)
    url = f"http://127.0.0.1/v1/rounds/{spec.round}/masked-input"
    sign_request(member.identity, "POST", url, {}, vector)


# -- the DP loop against plain Opacus ------------------------------------------------------


def dp_loop_ratio(records: int, batch: int, pairs: int, seed: int = 0) -> dict[str, Any]:
    """Seconds per epoch of fedsec's DP-SGD loop and of a plain Opacus loop on ResNet-18
    (32x32 RGB, 10 classes), run in ``pairs`` back-to-back pairs.

    The two loops of a pair start from the same weights, on the same records, with the
    same learning settings and the same Poisson batches (the plain loop samples with the
    generator fedsec's loop seeds); the pairs alternate which loop goes first
    (AB BA AB ...), so neither always runs warm or under the load a neighbour just
    started. A pair's two epochs run under nearly the same load, so its ratio is
    comparable where the epochs of different pairs are not: ``dp_loop_over_opacus`` is
    the median of the pairs' ratios, with their spread. ``noise_s_per_step`` times what
    fedsec's loop does and plain Opacus' does not: drawing one step's Gaussian noise for
    every parameter from the AES-CTR stream (4 normals a value, Opacus' secure-mode
    shape), against ``torch_noise_s_per_step``, torch's one normal a value.
    """
    import gc

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from fedsec.learning.dp_noise import secure_gaussian
    from fedsec.learning.training import DPParams, TrainingParams, _seeds, train_dataset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(records, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (records,), generator=generator)
    data = TensorDataset(x, y)
    params = TrainingParams(lr=0.05, batch_size=batch, local_epochs=1, momentum=0.9)
    dp = DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    torch.manual_seed(seed)
    initial = ResNet18().state_dict()
    ours: list[float] = []
    plain: list[float] = []

    def model() -> nn.Module:
        fresh = ResNet18()
        fresh.load_state_dict(initial)
        return fresh

    def released() -> None:
        # Opacus' hooks tie a wrapped model in reference cycles: without a collection its
        # per-sample gradients (1.4 GB at batch 32) outlive the epoch into the next one
        gc.collect()

    def fedsec_epoch(run: int, on: TensorDataset = data, out: list[float] = ours) -> None:
        start = time.perf_counter()
        train_dataset(model(), on, params, dp, device, seed + run)
        out.append(time.perf_counter() - start)
        released()

    def opacus_epoch(run: int, on: TensorDataset = data, out: list[float] = plain) -> None:
        torch.manual_seed(seed + run)  # Opacus' noise draws from it
        start = time.perf_counter()
        private_model = model().to(device)
        optimizer = torch.optim.SGD(
            private_model.parameters(), lr=params.lr, momentum=params.momentum
        )
        # the generator fedsec's loop samples with: both loops train on the same
        # Poisson batches, so a pair's epochs do the same work
        sampling = torch.Generator().manual_seed(_seeds(seed + run)[0])
        loader = DataLoader(on, batch_size=batch, shuffle=True, generator=sampling)
        private, optimizer, loader = PrivacyEngine().make_private(
            module=private_model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            poisson_sampling=True,
        )
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(nn.functional.cross_entropy(private(xb), yb))
            optimizer.step()
        out.append(time.perf_counter() - start)
        del private, optimizer, loader, private_model
        released()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        # one untimed step of each first: their one-time costs (imports, first kernel
        # calls, allocator growth) are in neither loop's epochs
        warm = TensorDataset(x[:batch], y[:batch])
        fedsec_epoch(pairs, warm, [])
        opacus_epoch(pairs, warm, [])
        for run in range(pairs):
            first, second = (
                (opacus_epoch, fedsec_epoch) if run % 2 else (fedsec_epoch, opacus_epoch)
            )
            first(run)
            second(run)
        noise_s, torch_noise_s = _noise_step_seconds(secure_gaussian, dp.noise_multiplier)
    ratios = sorted(a / b for a, b in zip(ours, plain, strict=True))
    return {
        "device": str(device),
        "records": records,
        "batch_size": batch,
        "steps_expected": math.ceil(records / batch),
        "pairs": pairs,
        "fedsec_epoch_s": [round(v, 2) for v in ours],
        "opacus_epoch_s": [round(v, 2) for v in plain],
        "pair_ratios": [round(a / b, 3) for a, b in zip(ours, plain, strict=True)],
        "dp_loop_over_opacus": round(statistics.median(ratios), 3),
        "pair_ratio_min": round(ratios[0], 3),
        "pair_ratio_max": round(ratios[-1], 3),
        # half the distance between the quartiles of the pair ratios (0 for one pair)
        "pair_ratio_spread": round(_half_iqr(ratios), 3),
        "ratio_of_medians": round(statistics.median(ours) / statistics.median(plain), 3),
        "noise_s_per_step": round(noise_s, 3),
        "torch_noise_s_per_step": round(torch_noise_s, 3),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def _half_iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2


def _noise_step_seconds(secure_gaussian: Any, std: float) -> tuple[float, float]:
    """One optimiser step's noise for every ResNet-18 parameter: fedsec's CSPRNG draw
    and torch's, each the best of three (the least disturbed by other load)."""
    shapes = [p.detach() for p in ResNet18().parameters()]
    ours, theirs = [], []
    for _ in range(3):
        start = time.perf_counter()
        for i, p in enumerate(shapes):
            secure_gaussian(b"\0" * 32, b"bench" + bytes([i % 256]), std, p)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        for p in shapes:
            torch.normal(0.0, std, p.shape)
        theirs.append(time.perf_counter() - start)
    return min(ours), min(theirs)


# -- command ------------------------------------------------------------------------------


def _fits(label: str, max_gib: float) -> tuple[bool, str]:
    d = _params(_model(label))
    need = d * _PEAK_BYTES_PER_PARAM / 2**30
    if need > max_gib:
        return False, (
            f"size {label} ({d} parameters) needs about {need:.1f} GiB at its peak, over "
            f"--max-gib {max_gib}"
        )
    return True, ""


@click.command("model-size")
@click.option(
    "--sizes", default="1M,11M,50M", show_default=True, help="comma-separated: 1M, 11M, 50M"
)
@click.option(
    "--members",
    "member_counts",
    default="10,40",
    show_default=True,
    help="member counts, comma-separated (the aggregator's memory must be flat in them)",
)
@click.option(
    "--member-counts-at",
    default="11M",
    show_default=True,
    help="the size run at every member count; other sizes run at the first count only",
)
@click.option("--max-gib", default=12.0, show_default=True, help="skip sizes needing more")
@click.option("--dp-records", default=256, show_default=True, help="records of the DP epoch")
@click.option("--dp-batch", default=32, show_default=True, help="expected batch of the DP loop")
@click.option(
    "--dp-repeats",
    default=5,
    show_default=True,
    help="back-to-back pairs of DP epochs (fedsec's, plain Opacus'); 0: no DP row",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_model_size(
    sizes: str,
    member_counts: str,
    member_counts_at: str,
    max_gib: float,
    dp_records: int,
    dp_batch: int,
    dp_repeats: int,
    seed: int,
    as_json: bool,
) -> None:
    """SecAgg+ rounds at 1M, 11M (ResNet-18) and 50M parameters; the DP loop's overhead."""
    counts = [int(c) for c in member_counts.split(",") if c]
    dp_row: dict[str, Any] | None = None
    if dp_repeats > 0:
        dp_row = dp_loop_ratio(dp_records, dp_batch, dp_repeats, seed)
    labels = [s.strip() for s in sizes.split(",") if s.strip()]
    if not labels and dp_row is not None:  # --sizes '': the DP loop's row alone
        row = {"bench": "model-size", "params": _params(ResNet18()), **dp_row}
        click.echo(json.dumps(with_environment(row)))
    for label in labels:
        if label not in SIZES:
            raise click.BadParameter(f"unknown size {label!r}; choose from {list(SIZES)}")
        fits, reason = _fits(label, max_gib)
        if not fits:
            click.echo(f"skipped: {reason}", err=True)
            continue
        for members in counts if label == member_counts_at else counts[:1]:
            row = {"bench": "model-size", **_round(label, members, seed)}
            row["dp_loop_over_opacus"] = None if dp_row is None else dp_row["dp_loop_over_opacus"]
            row["dp_loop"] = dp_row
            click.echo(json.dumps(with_environment(row)))
