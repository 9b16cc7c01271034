"""What GET /round answers follows every write that changes it, however the store keeps
its listing (ModelStore's kept listing of manifests/)."""

from __future__ import annotations

import os
from pathlib import Path

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.storage.models import ModelStore
from tests.support.aggregator import FakeClock, make_federation


def test_the_round_state_follows_published_models_and_added_challenges(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "ws", validation=False)
    coord = Coordinator(fed.ws, clock=FakeClock())
    models = fed.ws.models
    st = os.stat(models.manifests_dir)  # settled: the store may keep its listing
    os.utime(models.manifests_dir, ns=(st.st_atime_ns, st.st_mtime_ns - 60 * 10**9))
    first = coord.round_state()
    assert coord.round_state() == first
    token = coord.token
    # an operator's rollback, from another process (`fedsec aggregator rollback`)
    other = ModelStore(models.root, fed.ws.signer, fed.ws.federation_id)
    other.rollback(first.model_version)
    assert coord.round_state().model_version == first.model_version + 1
    models.rollback(first.model_version)  # this process's own write
    assert coord.round_state().model_version == first.model_version + 2
    fed.ws.state.challenges.add(1, 0, "a0", "auditor", b"{}")
    assert coord.round_state().challenges_issued == first.challenges_issued + 1
    assert coord.token == token  # neither changed the state token
