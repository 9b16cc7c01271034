"""FLTrust's reference update, as the trusted-mode summation session asks for it
(:data:`fedsec.summation.session.ReferenceUpdate`): the aggregator trains the round's
model on its own root dataset with the members' training code
(:mod:`fedsec.learning.reference`).  The model file read and the training happen here,
so the session stays free of I/O.

The root dataset comes from the task's bundled data, loaded the way the validation data
is (``task.load(seed=0)``, see ``_validation_data`` in :mod:`fedsec.aggregator.coordinator`),
but from its training split: the records the aggregator trusts are never the ones it
scores models on.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.modelfile import decode_model
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.tasks.base import TrainingParams
from fedsec.tasks.params import arrays_to_state

# fedsec.learning.reference (the members' training code, and with it Opacus: 50 MB of a
# serving aggregator's memory) is imported only by a federation whose rule is fltrust.


class RootReference:
    """Trains each fltrust attempt's reference; the root dataset is loaded once.

    Args:
        ctx: the round engine's shared context.

    Raises:
        ConfigError: the federation's rule is fltrust and the task's training split is
            smaller than ``aggregation.root_records`` (checked at start-up, not mid-round).
    """

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx
        self._root: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # records -> (x, y)
        ag = ctx.cfg.aggregation
        if ag.rule == "fltrust":  # fedsec.config allows a rule only where updates are seen
            self._root_dataset(ag.root_records)

    def _root_dataset(self, records: int) -> tuple[np.ndarray, np.ndarray]:
        if records not in self._root:
            from fedsec.learning.reference import root_dataset

            self._root[records] = root_dataset(self._ctx.task.load(seed=0), records)
        return self._root[records]

    def __call__(self, spec: wire.RoundSpec) -> np.ndarray:
        """The reference Δ₀ of ``spec``'s attempt: its model trained on the root dataset
        (the spec's training settings, no DP, a seed from the spec's), clipped to its
        clip norm."""
        from fedsec.learning.reference import reference_seed, reference_update

        assert spec.aggregation is not None  # the session asks only for an fltrust spec
        x, y = self._root_dataset(spec.aggregation.root_records)
        task = self._ctx.task
        model = task.build_model(0)
        data = self._ctx.ws.models.read(spec.model_version)
        arrays_to_state(model, decode_model(data, max_bytes=MAX_MODEL_BYTES))
        optimizer = cast(Literal["sgd", "adam"], spec.training.optimizer)
        params = TrainingParams(  # as members train (fedsec.agent.spec.training_params)
            lr=spec.training.lr,
            batch_size=spec.training.batch_size,
            local_epochs=spec.training.local_epochs,
            optimizer=optimizer,
            momentum=task.defaults.momentum if optimizer == "sgd" else 0.0,
        )
        delta = reference_update(
            model, x, y, params, spec.clip_norm, reference_seed(spec.seed), task=task
        )
        log.info(
            "event=fltrust_reference round=%d attempt=%d records=%d norm=%.6g",
            spec.round,
            spec.attempt,
            len(y),
            float(np.sqrt(np.einsum("i,i->", delta, delta))),
        )
        return delta
