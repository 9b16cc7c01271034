"""The image example's accuracy: ResNet-18 under DP-SGD, federated against central.

    python -m digits_images.accuracy --epsilon 8 --epochs 2 --rounds 2 --lr 0.1

(a) **Central**: DP-SGD (fedsec's own training loop, the one members run) on the
pooled train split, ``--epochs`` epochs, its noise sized so that every record's
(ε, δ) is ``--epsilon`` at the end.
(b) **Federated**: ``fedsec simulate`` of ``--agents`` members over loopback HTTP
(SecAgg+, a separate aggregator process), the train split dealt out IID, ``--rounds``
rounds of ``--epochs / --rounds`` local epochs each, every member training with
DP-SGD sized so that each of its records' (ε, δ) over all rounds is ``--epsilon``.

"The same ε" is the record-level guarantee: a record in the pooled set (a) and a
record held by any member (b) each get (ε, δ) = (``--epsilon``, ``DELTA``), with the
same per-record clip, batch size, optimiser and epochs per record. A member holds a
third of the records, so its sampling rate is three times the central one and its
noise multiplier larger; the federation's average then divides each member's noise by
√members.

Prints one JSON object: both accuracies on the folder's test split and the gap in
points (positive: the federation is worse).
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
#: Per-record gradient clip of DP-SGD, fedsec's [dp] max_grad_norm default.
MAX_GRAD_NORM = 1.0


def central(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """DP-SGD on the pooled train split; the test accuracy and what it cost."""
    task = load_task(args.task, path=str(folder))
    data = task.datasets()
    params = TrainingParams(
        lr=args.lr, batch_size=args.batch_size, local_epochs=args.epochs, momentum=args.momentum
    )
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
    spec = SimulationSpec(
        task=args.task,
        agents=args.agents,
        rounds=args.rounds,
        quant_bits=args.quant_bits,
        clip=args.update_clip,
        dp_epsilon=args.epsilon,
        local_epochs=args.epochs // args.rounds,
        lr=args.lr,
        batch_size=args.batch_size,
        server_optimizer="fedavg",
        server_lr=args.server_lr,
        seed=args.seed,
        baseline=False,
    )
    result = asyncio.run(run_simulation(spec))
    return {
        "federated_accuracy": round(result["final_accuracy"], 4),
        "federated_noise_multiplier": round(result["noise_multiplier"], 4),
        "federated_epsilon_max": result["epsilon_max"],
        "federated_rounds": result["rounds"],
        "federated_aborted_rounds": result["aborted_rounds"],
        "federated_s": result["wall_s"],
        "dim": result["dim"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m digits_images.accuracy")
    parser.add_argument("--task", default=TASK, help="digits_images: the small model")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=int, default=2, help="epochs each record is seen")
    parser.add_argument("--rounds", type=int, default=2, help="federated rounds")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--server-lr", type=float, default=1.0, help="FedAvg's")
    parser.add_argument("--update-clip", type=float, default=40.0)
    parser.add_argument("--quant-bits", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", type=Path, help="the image folder (default: written anew)")
    args = parser.parse_args(argv)
    if args.epochs % args.rounds:
        parser.error("--epochs must be a multiple of --rounds (local epochs per round)")
    if args.momentum:
        parser.error("the simulation trains without momentum: leave --momentum at 0")
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="digits-images-") as scratch:
        folder = args.folder or Path(scratch)
        if args.folder is None:
            make_folder(folder)
        row: dict[str, Any] = {
            "bench": "digits_images_accuracy",
            "task": args.task,
            "epsilon": args.epsilon,
            "delta": DELTA,
            "max_grad_norm": MAX_GRAD_NORM,
            "epochs": args.epochs,
            "rounds": args.rounds,
            "agents": args.agents,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "server_lr": args.server_lr,
            "update_clip": args.update_clip,
            "quant_bits": args.quant_bits,
            "seed": args.seed,
        }
        row.update(central(folder, args))
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress: the central half
        row.update(federated(folder, args))
    row["gap_pt"] = round(100 * (row["central_accuracy"] - row["federated_accuracy"]), 2)
    print(json.dumps(with_environment(row)))


if __name__ == "__main__":
    main()
