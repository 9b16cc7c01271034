"""Property-based fuzzing of the aggregator API from its own OpenAPI document.

schemathesis generates requests for every documented operation (schema-conforming
ones and deliberately invalid ones) and sends them to the real aggregator on a
loopback port.  Every request is signed by an enrolled agent's key over the exact
bytes that go on the wire (a ``requests`` auth hook runs after the URL and body are
final), so the generated values reach the handlers instead of all stopping at
authentication.  No answer may be a 5xx (schemathesis' ``not_a_server_error``).

Bounded: ``FEDSEC_FUZZ_EXAMPLES`` examples per operation and mode (default 20, a
fixed seed via ``derandomize``), long-poll waits clamped so no request is held.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok

from fedsec.aggregator.coordinator import Coordinator
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.endpoints import ENDPOINTS
from tests.support.aggregator import FakeClock, Federation, make_federation
from tests.support.hostile import HOST, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = int(os.environ.get("FEDSEC_FUZZ_EXAMPLES", "20"))
# A long-poll or held upload may wait up to 25 s; the fuzzer only needs the answer.
MAX_WAIT_S = 0.05


# Who signs an operation: the first of these roles the endpoint table grants it (an agent
# where it may, else the auditor, the key custodian, the observer).
SIGNER_PREFERENCE = ("agent", "auditor", "custodian", "observer")
# (method, path pattern, role): each endpoint's template as a regex over concrete paths
SIGNERS = [
    (
        ep.method,
        re.compile(re.sub(r"\\\{[a-z0-9_]+\\\}", "[^/]+", re.escape(ep.template))),
        next((role for role in SIGNER_PREFERENCE if role in ep.roles), "agent"),
    )
    for ep in ENDPOINTS
]


def signer_role(method: str, path: str) -> str:
    """The role that signs a request for ``path`` (the agent for a path off the table)."""
    for ep_method, pattern, role in SIGNERS:
        if ep_method == method and pattern.fullmatch(path):
            return role
    return "agent"


# Operations whose success answer never ends by itself.
STREAMING = {"/dashboard/api/events"}


class SignedAuth(requests.auth.AuthBase):
    """Signs each prepared request (RFC 9421) with the identity of the role the endpoint
    table grants the operation (:func:`signer_role`).

    Runs after ``requests`` has fixed the path, query and body, so the signature covers
    the bytes sent.  A target the signer refuses (not a valid URL) goes unsigned.
    """

    def __init__(self, identities: dict[str, SigningIdentity]) -> None:
        self.identities = identities  # role -> the identity that signs for it
        self.unsigned = 0

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body or b""
        if isinstance(body, str):
            body = body.encode()
        if not isinstance(body, bytes):
            self.unsigned += 1  # a streamed body: no exact bytes to sign
            return r
        assert r.method is not None
        target = r.path_url
        path = target.split("?", 1)[0]
        identity = self.identities[signer_role(r.method, path)]
        try:
            added = sign_request(identity, r.method, target, {}, body)
        except ValueError:
            self.unsigned += 1
            return r
        r.headers.update(added)
        return r


@contextmanager
def served_in_thread(fed: Federation) -> Iterator[str]:
    """The aggregator on a loopback port, its event loop in a thread of its own (the
    fuzzer's ``requests`` calls block)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    stop = asyncio.Event()

    async def main() -> None:
        served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
        port.append(served.port)
        ready.set()
        try:
            await stop.wait()
        finally:
            await served.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the aggregator did not start"
        yield f"http://{HOST}:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


def _clamp_waits(case: schemathesis.Case) -> None:
    """Hold no request: numeric ``timeout`` (GET /round) and ``wait`` (seconds, on the
    stage endpoints) over MAX_WAIT_S become MAX_WAIT_S; other values are left to be
    refused as generated."""
    query = case.query
    if not isinstance(query, dict):
        return
    names = ("timeout",) if case.path == "/v1/round" else ("timeout", "wait")
    for name in names:
        value = query.get(name)
        try:
            seconds = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if not seconds <= MAX_WAIT_S:  # also NaN
            query[name] = MAX_WAIT_S


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(
        tmp_path / "ws",
        agents=("a0", "a1", "a2"),
        observers=("obs",),
        auditors=("aud",),
        custodians=("kh",),
        # the fuzzer is one member at full speed; the quota is test_hostile's concern
        server={"member_rate_per_s": 1_000_000.0, "member_burst": 1_000_000},
        validation=False,
    )


def test_generated_requests_never_get_a_server_error(fed: Federation) -> None:
    statuses: collections.Counter[int] = collections.Counter()
    per_operation: dict[str, collections.Counter[int]] = {}
    server_errors: list[str] = []
    ids = fed.identities
    auth = SignedAuth(
        {"agent": ids["a0"], "auditor": ids["aud"], "custodian": ids["kh"], "observer": ids["obs"]}
    )
    started = time.monotonic()
    with served_in_thread(fed) as base_url, requests.Session() as session:
        doc = session.get(f"{base_url}/v1/openapi.json", timeout=10).json()
        schema = schemathesis.openapi.from_dict(doc)
        operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
        assert len(operations) == len([m for ops in doc["paths"].values() for m in ops]), (
            "schemathesis could not load every documented operation"
        )
        # The live-event stream answers 200 and then streams for minutes: a generated
        # request would only wait on it.  Its refusals are tested in test_ops_access.
        operations = [op for op in operations if op.path not in STREAMING]

        def send(case: schemathesis.Case) -> None:
            _clamp_waits(case)
            response = case.call(base_url=base_url, session=session, auth=auth, timeout=30)
            label = case.operation.label
            per_operation.setdefault(label, collections.Counter())[response.status_code] += 1
            statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=[not_a_server_error])
            except Exception as exc:  # recorded, asserted below
                server_errors.append(f"{label} {case.path_parameters} {case.query}: {exc}")

        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(operation.as_strategy(generation_mode=mode), send)

    elapsed = time.monotonic() - started
    total = sum(statuses.values())
    print(
        f"\nfuzzed {total} requests in {elapsed:.1f} s; statuses {dict(sorted(statuses.items()))}"
    )
    for label, counts in sorted(per_operation.items()):
        print(f"  {label}: {dict(sorted(counts.items()))}")
    assert server_errors == []
    assert not any(status >= 500 for status in statuses)
    # the signing hook works: generated requests got past authentication
    past_auth = total - statuses[401]
    assert statuses[200] > 0 and past_auth > total // 2, (statuses, auth.unsigned)


def _fuzz(strategy: Any, send: Any) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # failures are recorded, not shrunk
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        send(case)

    with contextlib.suppress(Unsatisfiable):  # nothing invalid to generate in this mode
        run()
