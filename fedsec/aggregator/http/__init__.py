"""The aggregator's HTTP API (aiohttp): authentication, limits, errors, long-polling.

Handlers only move bytes: they authenticate the request (RFC 9421 signature, roster
role), decode the body with its size limit, call the coordinator and encode the answer.

Read in this order: :mod:`.limits` (the layer's own limits and why), :mod:`.keys` (what
the application and a request carry), :mod:`.errors` (answers, refusals, our bugs),
:mod:`.auth` (the checks of ``docs/security.md``, in order), :mod:`.params` (path and
query parameters, JSON bodies), :mod:`.longpoll` (holding an answer until the round
changes), :mod:`.handlers` (the endpoints) and :mod:`.app` (:func:`make_app`).  The
listener and its connection rules are :mod:`fedsec.aggregator.transport`.
"""

from __future__ import annotations

from fedsec.aggregator.http.app import make_app

__all__ = ["make_app"]
