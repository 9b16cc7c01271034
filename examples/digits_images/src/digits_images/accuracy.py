"""The image example's accuracy: ResNet-18 under DP-SGD, federated against central.

    python -m digits_images.accuracy --epsilon 8 --epochs 2 --batch-size 32 --lr 0.1

(a) **Central**: DP-SGD (fedsec's own training loop, the one members run) on the
pooled train split, ``--epochs`` epochs of Poisson-sampled batches of expected size
``--batch-size``, plain SGD at ``--lr``, its noise sized so that every record's
(ε, δ) is ``--epsilon`` at the end.
(b) **Federated**: ``fedsec simulate`` of ``--agents`` members over loopback HTTP
(SecAgg+, a separate aggregator process), the train split dealt out IID, every
record's (ε, δ) over all rounds ``--epsilon``, with the noise added as
``--dp-mode`` says:

- ``distributed`` (the default): record-level distributed DP
  (``fedsec/learning/distributed.py``). A round is one DP-SGD step over the union of
  the members' records: each member Poisson-samples its records at the central run's
  rate, sums their clipped gradients and adds a share of the noise inside the SecAgg+
  ring; the aggregator applies the noisy sum divided by the expected batch with plain
  SGD at ``--lr`` (FedAvg, server learning rate = ``--lr``). As many rounds as the
  central run has steps, so both runs are the same DP-SGD (rate, σ, steps, clip, lr);
  what differs is the discretised noise and the 16-bit ring. The ε holds against
  anyone who sees only the sum if every member (``MIN_SURVIVORS_FRACTION``) adds its
  share honestly.
- ``local``: every member adds all of its noise to its own DP-SGD run, ``--rounds``
  rounds of ``--epochs / --rounds`` local epochs, FedAvg at ``--server-lr``. The ε
  then holds against everyone, the other members included, but a member holds a
  third of the records: its sampling rate is three times the central one, its noise
  multiplier larger, and the average of the members' noises is √members times what
  central DP-SGD adds at the same batch.

Prints one JSON object: the settings, both accuracies on the folder's test split, the
gap in points (positive: the federation is worse), times and versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from digits_images.make_folder import make_folder
from fedsec.agent.accountant import noise_for_budget
from fedsec.bench.common import with_environment
from fedsec.learning.training import DPParams, plan_round, train_dataset
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.simulation import SimulationSpec, run_simulation
from fedsec.task import TrainingParams, load_task
from fedsec.tasks.evaluation import evaluate_dataset

TASK = "digits_images_resnet18"
#: δ of every run: the simulation's, well below 1/records for 1,438 records.
DELTA = DEFAULT_DELTA
#: Per-record gradient clip of DP-SGD, fedsec's [dp] max_grad_norm default (and the
#: record clip of fedsec's record-level distributed DP, DDP_RECORD_CLIP).
MAX_GRAD_NORM = 1.0
#: Distributed DP: the noise shares add up to the full noise with every member of the
#: cohort (3 of 3); a round with a member lost aborts before unmasking. A smaller
#: fraction would tolerate a lost member at 1/fraction of the noise when all survive.
MIN_SURVIVORS_FRACTION = 1.0


def central_params(args: argparse.Namespace) -> TrainingParams:
    """The central run's DP-SGD settings (plain SGD: the members' optimiser too)."""
    return TrainingParams(lr=args.lr, batch_size=args.batch_size, local_epochs=args.epochs)


def central_plan(folder: Path, args: argparse.Namespace) -> tuple[float, int]:
    """(Poisson sampling rate, steps) of the central run over the pooled train split."""
    train = load_task(args.task, path=str(folder)).datasets().train
    return plan_round(len(train), central_params(args))


def central(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """DP-SGD on the pooled train split; the test accuracy and what it cost."""
    task = load_task(args.task, path=str(folder))
    data = task.datasets()
    params = central_params(args)
    rate, steps = plan_round(len(data.train), params)
    noise = noise_for_budget(args.epsilon, DELTA, rate, steps, 1)
    model = task.build_model(args.seed)
    started = time.perf_counter()
    result = train_dataset(
        model, data.train, params, DPParams(noise, MAX_GRAD_NORM, DELTA), "cpu", args.seed,
        task=task,
    )  # fmt: skip
    sums = evaluate_dataset(model, data.test, task)
    return {
        "central_accuracy": round(sums.values()["accuracy"], 4),
        "central_noise_multiplier": round(noise, 4),
        "central_sample_rate": round(rate, 5),
        "central_steps": result.steps,
        "central_s": round(time.perf_counter() - started, 1),
    }


def federated(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``fedsec simulate``: the federation's test accuracy and what it cost."""
    os.environ["DIGITS_IMAGES_DIR"] = str(folder)  # simulate passes no task options
    common: dict[str, Any] = {
        "task": args.task,
        "agents": args.agents,
        "dp_epsilon": args.epsilon,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "server_optimizer": "fedavg",
        "seed": args.seed,
        "baseline": False,
    }
    if args.dp_mode == "distributed":
        # One round is one DP-SGD step over the union of the members' records: the
        # central run's sampling rate and step count, the union's noisy mean gradient
        # applied with the central run's learning rate.
        rate, steps = central_plan(folder, args)
        spec = SimulationSpec(
            **common,
            rounds=steps,
            dp_mode="distributed",
            dp_unit="record",
            dp_sample_rate=rate,
            dp_min_survivors=MIN_SURVIVORS_FRACTION,
            quant_bits=args.quant_bits,
            local_epochs=1,
            server_lr=args.lr,
        )
    else:
        spec = SimulationSpec(
            **common,
            rounds=args.rounds,
            quant_bits=args.quant_bits,
            clip=args.update_clip,
            local_epochs=args.epochs // args.rounds,
            server_lr=args.server_lr,
        )
    started = time.perf_counter()
    # On disk, not in /dev/shm where the simulation would put it: every round keeps the
    # members' masked uploads (state and audit archive), their vault entries and the
    # model, about 0.45 GB a round at 11M parameters, 41 GB over 90 rounds.
    with tempfile.TemporaryDirectory(prefix="digits-images-federation-") as home:
        result = asyncio.run(run_simulation(spec, Path(home)))
    return {
        "federated_accuracy": round(result["final_accuracy"], 4),
        "federated_noise_multiplier": round(result["noise_multiplier"], 4),
        "federated_epsilon_max": result["epsilon_max"],
        "federated_rounds": result["rounds"],
        "federated_aborted_rounds": result["aborted_rounds"],
        "federated_s": result["wall_s"],
        "federated_total_s": round(time.perf_counter() - started, 1),
        "federated_round_s_mean": result["round_s_mean"],
        "dim": result["dim"],
        # distributed DP: the noise the sums carried (≥ the central run's) and the
        # share of their coordinates at the ring's edge
        **{
            f"federated_{key}": result[key]
            for key in ("realised_noise_multiplier_min", "survivors_min", "wrap_rate")
            if key in result
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m digits_images.accuracy")
    parser.add_argument("--task", default=TASK, help="digits_images: the small model")
    parser.add_argument(
        "--dp-mode",
        choices=("distributed", "local"),
        default="distributed",
        help="who adds the federation's noise: the SecAgg+ sum's shares (a round is one "
        "DP-SGD step of the union) or each member all of its own",
    )
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=int, default=2, help="epochs each record is seen")
    parser.add_argument(
        "--rounds", type=int, default=2, help="local DP: rounds (distributed: the central steps)"
    )
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--server-lr", type=float, default=1.0, help="local DP: FedAvg's (distributed: --lr)"
    )
    parser.add_argument("--update-clip", type=float, default=40.0, help="local DP only")
    parser.add_argument("--quant-bits", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", type=Path, help="the image folder (default: written anew)")
    parser.add_argument(
        "--only", choices=("central", "federated"), help="run one half (no gap: a trial)"
    )
    args = parser.parse_args(argv)
    if args.dp_mode == "local" and args.epochs % args.rounds:
        parser.error("--epochs must be a multiple of --rounds (local epochs per round)")
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="digits-images-") as scratch:
        folder = args.folder or Path(scratch)
        if args.folder is None:
            make_folder(folder)
        row: dict[str, Any] = {
            "bench": "digits_images_accuracy",
            "task": args.task,
            "dp_mode": args.dp_mode,
            "epsilon": args.epsilon,
            "delta": DELTA,
            "max_grad_norm": MAX_GRAD_NORM,
            "epochs": args.epochs,
            "agents": args.agents,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "optimizer": "sgd",
            "quant_bits": args.quant_bits,
            "seed": args.seed,
        }
        if args.dp_mode == "distributed":
            row.update({"server_lr": args.lr, "min_survivors_fraction": MIN_SURVIVORS_FRACTION})
        else:
            row.update(
                {
                    "rounds": args.rounds,
                    "server_lr": args.server_lr,
                    "update_clip": args.update_clip,
                }
            )
        if args.only != "federated":
            row.update(central(folder, args))
            print(json.dumps(row), file=sys.stderr, flush=True)  # progress: the central half
        if args.only != "central":
            row.update(federated(folder, args))
    if args.only is None:
        row["gap_pt"] = round(100 * (row["central_accuracy"] - row["federated_accuracy"]), 2)
    print(json.dumps(with_environment(row)))


if __name__ == "__main__":
    main()
