"""Centralized (non-federated, non-DP) baselines of the bundled tasks.

Prints one JSON object per line: task, epochs, hyperparameters, test accuracy, test
loss, wall time and software versions. Run: ``.venv/bin/python bench/centralized_check.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict

import torch

from fedsec.agent.device import resolve_device
from fedsec.learning.training import train_centralized
from fedsec.tasks import TASKS, get_task

DEFAULT_EPOCHS = {"breast_cancer": 10, "digits": 30, "mnist1d": 100}


def main() -> None:
    """Train each requested task centrally and print its test accuracy and wall time."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", action="append", choices=[t for t in TASKS if t != "csv"])
    parser.add_argument("--epochs", type=int, action="append")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    for name in args.task or list(DEFAULT_EPOCHS):
        task = get_task(name)
        dataset = task.load()
        for epochs in args.epochs or [DEFAULT_EPOCHS[name]]:
            started = time.perf_counter()
            accuracy, loss = train_centralized(task, dataset, epochs, device, args.seed)
            record = {
                "bench": "centralized",
                "task": name,
                "task_version": task.version,
                "epochs": epochs,
                "seed": args.seed,
                "params": asdict(task.defaults),
                "test_accuracy": round(accuracy, 4),
                "test_loss": round(loss, 4),
                "wall_s": round(time.perf_counter() - started, 2),
                "device": str(device),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "python": platform.python_version(),
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
