"""Bundled example tasks (data loader + model + defaults) and the helpers around them.

Tasks use real data shipped by packages (scikit-learn's bundled sets, MNIST-1D generated
locally) or a member's own CSV file; nothing is downloaded.
"""

from fedsec.tasks.base import Dataset, Task, TaskSchema, TrainingParams, check_schema
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.partition import (
    PartitionSpec,
    parse_partition,
    partition_dirichlet,
    partition_iid,
)
from fedsec.tasks.registry import TASKS, get_task

__all__ = [
    "TASKS",
    "Dataset",
    "PartitionSpec",
    "Task",
    "TaskSchema",
    "TrainingParams",
    "check_schema",
    "evaluate",
    "get_task",
    "parse_partition",
    "partition_dirichlet",
    "partition_iid",
]
