"""Helpers of the agent tests: a signed round spec with every field set, and the real
aggregator app served on a loopback port for agents to run rounds against."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.wire import DPSpec, RoundSpec, TrainingSpec
from fedsec.tasks.base import Task
from tests.support.aggregator import Federation

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def signed_spec(
    signer: SigningIdentity,
    local_task: Task,
    /,
    *,
    federation_id: str,
    model_sha256: str,
    dim: int,
    cohort: tuple[str, ...],
    **changes: Any,
) -> RoundSpec:
    """A plain-mode spec of round 1 attempt 1 for ``cohort``, signed by ``signer``;
    ``changes`` override any field (``task`` included: the first two arguments are
    positional only)."""
    fields: dict[str, Any] = {
        "federation_id": federation_id,
        "round": 1,
        "attempt": 1,
        "secure_sum": "none",
        "model_version": 1,
        "model_sha256": model_sha256,
        "task": local_task.name,
        "task_version": local_task.version,
        "schema_fingerprint": local_task.schema.fingerprint(),
        "cohort": sorted(cohort),
        "neighbors": max(len(cohort) - 1, 0),
        "threshold": 2,
        "quant_bits": 8,
        "ring_bits": 16,
        "clip_norm": 1.0,
        "dim": dim,
        "seed": "11" * 32,
        "max_weight_samples": 1000,
        "weight_caps": {},
        "training": TrainingSpec(local_epochs=1, batch_size=32, lr=0.05, optimizer="sgd"),
        "dp": DPSpec(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
        "deadlines": {},
    }
    fields.update(changes)
    return RoundSpec(**fields).sign(signer)


# -- agents against the real aggregator ------------------------------------------------------


@dataclass
class LiveAggregator:
    """The real aggregator app (its coordinator, its workspace) on a loopback port, with
    a record of every request it got and temporary refusals to answer first."""

    fed: Federation
    coordinator: Coordinator
    url: str = ""
    #: (method, path) of each request, in arrival order (refused ones too)
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: (method, path) -> (status, code) answers to give first, before the real app
    refusals: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    #: asked first for every request: a (status, code) to refuse it with, or None
    refuse_when: Callable[[tuple[str, str]], tuple[int, str] | None] | None = None
    refused: list[tuple[str, str]] = field(default_factory=list)
    #: called once a request to (method, path) was answered (after the real app)
    after: dict[tuple[str, str], Callable[[], None]] = field(default_factory=dict)

    @property
    def ws(self) -> Workspace:
        return self.fed.ws

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = (request.method, request.path)
        self.requests.append(route)
        pending = self.refusals.get(route)
        refusal = self.refuse_when(route) if self.refuse_when is not None else None
        if refusal is None and pending:
            refusal = pending.pop(0)
        if refusal is not None:
            self.refused.append(route)
            status, code = refusal
            return web.json_response(
                {"error": code, "detail": f"{code}, try later"},
                status=status,
                headers={"Retry-After": "0"},
            )
        response = await handler(request)
        if route in self.after:
            self.after[route]()
        return response


@contextlib.asynccontextmanager
async def live_aggregator(fed: Federation) -> AsyncIterator[LiveAggregator]:
    """Serve ``fed``'s workspace with the real aggregator app on 127.0.0.1."""
    coordinator = Coordinator(fed.ws)
    live = LiveAggregator(fed, coordinator)
    app = make_app(fed.ws, coordinator)
    app.middlewares.insert(0, live._middleware)
    server = await start_server(app, "127.0.0.1", 0, None, fed.ws.config.server)
    live.url = server.url
    try:
        yield live
    finally:
        await server.close()
