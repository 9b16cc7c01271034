"""``fedsec agent inventory``: this member's data map, from what ``agent.toml`` names.

The sources are ``[[data.sources]]``, or the ``data.csv`` file of a csv task; the rules
and the federation schema are used when present, so the command helps write the rules
first and shows what they keep afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsec.config import AgentConfig
from fedsec.errors import ConfigError


def member_data_map(cfg: AgentConfig, label: str = "") -> dict[str, Any]:
    """The data map of the sources ``cfg`` names (``label``: the label column, before a
    schema names it).

    Raises:
        ConfigError: no source configured, or a source cannot be read.
    """
    from fedsec.data.inventory import build_map
    from fedsec.data.rules import load_hash_key
    from fedsec.data.settings import SourceSpec
    from fedsec.data.sources import open_source

    specs = list(cfg.data.sources)
    if not specs and cfg.data.csv:
        specs = [SourceSpec(kind="csv", path=cfg.data.csv)]
    if not specs:
        images = _image_folder_map(cfg)
        if images is not None:
            return images
        raise ConfigError(
            "nothing to inventory: add a [[data.sources]] entry (csv, parquet or sql) to "
            "agent.toml, set data.csv, or name an image folder in [data] task_options path"
        )
    rules = cfg.data.rules
    key = None
    if rules is not None and "hash" in rules.anonymise.values():
        default = Path(cfg.agent.state_dir) / "anonymise.key"
        key = load_hash_key(rules.hash_key_file or str(default))
    data_map = build_map([open_source(s) for s in specs], rules, cfg.data.schema, key, label)
    data_map["member"] = cfg.agent.id
    return data_map


#: Split folders an image folder may hold, each with its own class folders.
_IMAGE_SPLITS = ("train", "test")


def _image_folder_map(cfg: AgentConfig) -> dict[str, Any] | None:
    """The inventory of the image folder the task options name (``path``), per split
    folder (``train``, ``test``) where it has them; None when the task's input is not
    an image or no folder is named.

    Raises:
        ConfigError: the task is unknown or its options are bad.
        TaskMismatch: see :func:`fedsec.data.images.image_inventory`.
    """
    from fedsec.data.images import image_inventory
    from fedsec.tasks import get_task

    root = cfg.data.task_options.get("path")
    if not isinstance(root, str) or not Path(root).is_dir():
        return None
    schema = get_task(cfg.data.task, **cfg.data.task_options).schema
    if len(schema.input_shape) != 3:
        return None
    classes = schema.class_names or tuple(str(i) for i in range(schema.num_classes))
    splits = [Path(root) / s for s in _IMAGE_SPLITS if (Path(root) / s).is_dir()]
    return {
        "sources": [],
        "images": [
            image_inventory(folder, classes, schema.input_shape)
            for folder in splits or [Path(root)]
        ],
        "member": cfg.agent.id,
    }
