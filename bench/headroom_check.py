"""Does the compressed codec need its full ring headroom?  Measured, in-process.

The ring keeps m = b + ⌈log₂ n⌉ bits so that the sum of n offset b-bit values never
wraps, whatever the data (``fedsec.crypto.quantize.default_ring_bits``).  Issue 17 asks
whether fewer headroom bits h, with the wraps counted, keep the accuracy, since every
bit cut lets a member send more coordinates at the same payload.

Each round, every member trains from the global model with the task's simulation
settings (``fedsec.simulation.SIM_DEFAULTS``), clips to the simulation's clip and
encodes with the real codec (:class:`fedsec.protocol.update_codec.UpdateCodec`: shared
Hadamard rotation, shared subset, b-bit rounding over ±range_stddevs·clip/√N).  The exact
integer sum S of the encodings is formed, and a ring of b + h bits is emulated: the
decoder sees S mod 2^(b+h), subtracts the n offsets, recentres, and decodes with the
codec as the aggregator does.  A coordinate whose centred sum lies outside the smaller
ring's half range wraps and is counted; the weight element is summed exactly (it would
travel with full headroom).  The server applies FedAvg with the task's server lr.

Three variations screen other ways to the 16x target, none of them a product setting:
``--server-momentum β`` applies an exponential average of the mean updates
(v ← βv + (1 − β)·mean, the model moves by server_lr·v), ``--drop-edges`` decodes every
sum the aggregator would count as a likely wrap (the outer
:data:`~fedsec.protocol.update_codec.WRAP_EDGE_FRACTION` of the ring) as an unsent
coordinate, and ``--local-epochs`` / ``--server-lr`` replace the task's settings.
``--server-optimizer fedadam`` applies the product's FedAdam
(:func:`fedsec.learning.optimizers.server_step`, ``[server]``'s default moments).

Prints one JSON object per run: the settings, the payload bytes per member and round,
the wrap rate, the largest centred |sum| in levels and the bits it needed, and the final
test accuracy.  Run: ``.venv/bin/python bench/headroom_check.py --headroom 6 5 4``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from typing import Literal

import numpy as np
import torch

from fedsec.bench.secagg import codec_round_spec
from fedsec.config import ServerSection
from fedsec.crypto.quantize import QuantSpec, default_ring_bits
from fedsec.learning.optimizers import AdamMoments, server_rule, server_step
from fedsec.learning.training import train_local
from fedsec.protocol.codec_choice import codec_for, default_range_stddevs
from fedsec.protocol.update_codec import WRAP_EDGE_FRACTION, UpdateCodec
from fedsec.protocol.wire import CodecSpec
from fedsec.simulation import FEDADAM_LR, SIM_DEFAULTS
from fedsec.tasks import TrainingParams, get_task, parse_partition
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params, load_flat_params


def _codec(
    d: int, members: int, bits: int, keep: float, clip: float, stddevs: float | None, seed: bytes
) -> UpdateCodec:
    """The codec a round spec with these settings prescribes (``fedsec.simulate``'s
    choices): rotated when keep < 1, over ``stddevs`` (None: the tool's default range),
    plain 8-bit-style else."""
    rotation: Literal["none", "hadamard"] = "hadamard" if keep < 1.0 else "none"
    quant = QuantSpec(bits, clip, default_ring_bits(bits, members))
    cohort = [f"member-{i}" for i in range(members)]
    if stddevs is None or rotation == "none":
        stddevs = default_range_stddevs(rotation)
    codec = CodecSpec(rotation=rotation, keep=keep, range_stddevs=stddevs)
    return codec_for(codec_round_spec(cohort, quant, d, codec, seed))


def run(args: argparse.Namespace, headroom: int, keep: float) -> dict[str, object]:
    """One federation of ``args.rounds`` rounds with a ring of bits + headroom."""
    torch.manual_seed(args.seed)
    defaults = SIM_DEFAULTS[args.task]
    params = TrainingParams(
        local_epochs=args.local_epochs or defaults["local_epochs"],
        batch_size=defaults["batch_size"],
        lr=defaults["lr"],
        optimizer=defaults["optimizer"],
    )
    clip = defaults["clip"]
    fedadam = args.server_optimizer == "fedadam"
    server_lr = args.server_lr or (FEDADAM_LR if fedadam else defaults.get("server_lr", 1.0))
    server = ServerSection()  # [server]'s default FedAdam moments
    rule = server_rule(
        args.server_optimizer, server_lr, server.adam_beta1, server.adam_beta2, server.adam_tau
    )
    moments: AdamMoments | None = None
    velocity: np.ndarray | None = None  # --server-momentum's average of mean updates
    task = get_task(args.task)
    data = task.load()
    parts = parse_partition("iid").apply(data.y_train, args.agents, args.seed)
    model = task.build_model(args.seed)
    g = flatten_params(model).astype(np.float64)
    d, n = g.size, args.agents
    full = default_ring_bits(args.bits, n)  # the codec's own ring
    small = args.bits + headroom
    levels = (1 << args.bits) - 1
    wrapped = coords = 0
    peak = 0
    started = time.perf_counter()
    for r in range(1, args.rounds + 1):
        seed = hashlib.sha256(b"headroom %d %d" % (args.seed, r)).digest()
        codec = _codec(d, n, args.bits, keep, clip, args.range_stddevs, seed)
        total = np.zeros(codec.length, dtype=np.int64)
        for i, idx in enumerate(parts):
            local = task.build_model(0)
            load_flat_params(local, g.astype(np.float32))
            train_local(
                local, data.x_train[idx], data.y_train[idx], params, None, "cpu", r * 1009 + i
            )
            delta = flatten_params(local).astype(np.float64) - g
            norm = float(np.linalg.norm(delta))
            if norm > clip:
                delta *= clip / norm
            secret = hashlib.sha256(seed + b"member %d" % i).digest()
            total += codec.encode(delta, 1.0, secret).ring.astype(np.int64)
        body = total[:-1]
        # centred sum in half-levels: 2·Σ(v − L/2) = 2S − n·L (exact integers)
        twice = 2 * body - n * levels
        peak = max(peak, int(np.max(np.abs(twice))) // 2 + 1)
        half = 1 << (small - 1)
        wraps = np.abs(twice) >= 2 * half
        wrapped += int(np.count_nonzero(wraps))
        coords += body.size
        # what a decoder of the b + h-bit ring recovers: S mod 2^(b+h), minus the offsets,
        # recentred, plus the offsets again
        modulus = 1 << small
        offset2 = n * levels  # 2·n·L/2
        seen = np.mod(body, modulus)
        centred2 = np.mod(2 * seen - offset2, 2 * modulus)
        centred2[centred2 >= modulus] -= 2 * modulus
        if args.drop_edges:  # a likely wrap becomes an unsent coordinate (centred sum 0)
            centred2[np.abs(centred2) > 2 * half * (1 - WRAP_EDGE_FRACTION)] = 0
        recovered = (centred2 + offset2) // 2
        ring_sum = np.concatenate([np.mod(recovered, 1 << full), total[-1:]])
        update, weight = codec.decode_sum(ring_sum.astype(np.uint64), n)
        mean = update / weight
        if args.server_momentum:
            beta = args.server_momentum
            velocity = mean if velocity is None else beta * velocity + (1 - beta) * mean
            mean = velocity
        if fedadam:
            new, moments = server_step(rule, g.astype(np.float32), mean.astype(np.float32), moments)
            g = new.astype(np.float64)
        else:
            g = g + server_lr * mean
    final = task.build_model(0)
    load_flat_params(final, g.astype(np.float32))
    accuracy = float(evaluate(final, data.x_test, data.y_test)[0])
    payload = math.ceil((codec.length * small) / 8)
    stddevs = round(codec.range * math.sqrt(codec.padded) / clip, 6) if keep < 1 else None
    return {
        "bench": "headroom",
        "task": args.task,
        "agents": n,
        "rounds": args.rounds,
        "seed": args.seed,
        "bits": args.bits,
        "keep": keep,
        "range_stddevs": stddevs,
        "headroom_bits": headroom,
        "ring_bits": small,
        "full_ring_bits": full,
        "payload_bytes_per_agent_round": payload,
        "payload_compression_ratio": round(4 * d / payload, 3),
        "wrap_rate": wrapped / coords,
        "peak_centred_levels": peak,
        "peak_needs_ring_bits": math.ceil(math.log2(peak + 1)) + 1,
        "local_epochs": params.local_epochs,
        "server_optimizer": args.server_optimizer,
        "server_lr": server_lr,
        "server_momentum": args.server_momentum,
        "drop_edges": args.drop_edges,
        "final_accuracy": accuracy,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    """Run one federation per (headroom, keep) pair and print each as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", default="mnist1d", choices=list(SIM_DEFAULTS))
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--headroom", type=int, nargs="+", default=[6])
    parser.add_argument("--keep", type=float, nargs="+", default=[0.38])  # 1: plain
    parser.add_argument("--range-stddevs", type=float, default=None)  # None: the default
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-epochs", type=int, default=0)  # 0: the task's
    parser.add_argument("--server-lr", type=float, default=0.0)  # 0: the task's
    parser.add_argument("--server-momentum", type=float, default=0.0)  # 0: plain FedAvg
    parser.add_argument("--server-optimizer", choices=["fedavg", "fedadam"], default="fedavg")
    parser.add_argument("--drop-edges", action="store_true")
    args = parser.parse_args()
    if args.server_momentum and args.server_optimizer == "fedadam":
        parser.error("--server-momentum averages FedAvg's updates; FedAdam has its own moments")
    torch.set_num_threads(1)
    for headroom, keep in zip(args.headroom, args.keep, strict=True):
        print(json.dumps(run(args, headroom, keep)), flush=True)


if __name__ == "__main__":
    main()
