"""What a task is: the definitions of :mod:`fedsec.task`, under their older import path.

The bundled tasks and the code that runs them import from here; task packages import
from :mod:`fedsec.task`. Both name the same classes.
"""

from fedsec.task.defaults import Optimizer, TrainingParams
from fedsec.task.definition import Dataset, DataSource, Task, TaskData, tensor_data
from fedsec.task.schema import TaskSchema, check_schema

__all__ = [
    "DataSource",
    "Dataset",
    "Optimizer",
    "Task",
    "TaskData",
    "TaskSchema",
    "TrainingParams",
    "check_schema",
    "tensor_data",
]
