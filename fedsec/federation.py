"""Set up a whole local federation: workspace, enrolled agents and their configs.

Shared by ``fedsec demo`` (separate processes), ``fedsec simulate`` (one process)
and the end-to-end tests, so all three run the same set-up code.

Every federation made here also enrols the operator (:data:`OBSERVER_ID`, role
``observer``) with a key of its own: ``GET /v1/status`` carries alerts and round
history, so the tools that watch a run sign it like any other request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from fedsec.aggregator.workspace import Workspace, init_workspace
from fedsec.config import (
    AgentConfig,
    AgentSection,
    AlertsSection,
    CodecSection,
    DashboardSection,
    DataSection,
    DPSection,
    FederationConfig,
    FederationSection,
    HeSection,
    MetricsSection,
    NetworkSection,
    PrivacySection,
    RoundSection,
    ServerSection,
    TrainingSection,
    ValidationSection,
    dump_agent_config,
    fill_server_defaults,
    render_toml,
    table_task_options,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.data.settings import ColumnRules, SourceSpec
from fedsec.errors import ConfigError
from fedsec.keys import load_identity, save_identity, save_public_key
from fedsec.protocol.data_schema import DataSchema
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.protocol.roster import Role, sign_roster_entry

#: The roster id of the local operator that watches a federation's status.
OBSERVER_ID = "operator"


@dataclass
class LocalAgent:
    agent_id: str
    root: Path
    identity: SigningIdentity

    @property
    def config_path(self) -> Path:
        return self.root / "agent.toml"


def federation_toml(
    federation_id: str,
    task: str,
    *,
    round_: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    dp: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    alerts: dict[str, Any] | None = None,
    dashboard: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    he: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
    schema: DataSchema | None = None,
    codec: dict[str, Any] | None = None,
) -> str:
    """A federation.toml with the given overrides of each section's defaults (and, for
    task ``table``, the federation's data ``schema``)."""
    cfg = FederationConfig(
        federation=FederationSection(id=federation_id, task=task),
        round=RoundSection(**(round_ or {})),
        training=TrainingSection(**(training or {})),
        dp=DPSection(**(dp or {})),
        server=ServerSection(**_server(server, dp)),
        alerts=AlertsSection(**(alerts or {})),
        dashboard=DashboardSection(**(dashboard or {})),
        metrics=MetricsSection(**(metrics or {})),
        he=HeSection(**(he or {})),
        validation=ValidationSection(**(validation or {})),
        schema=schema,
        codec=CodecSection(**(codec or {})),
    )
    return render_toml(cfg, f"fedsec federation {federation_id}")


def _server(server: dict[str, Any] | None, dp: dict[str, Any] | None) -> dict[str, Any]:
    """``server`` with the optimiser and learning rate the DP settings give where unset."""
    doc: dict[str, Any] = {"server": dict(server or {}), "dp": dict(dp or {})}
    fill_server_defaults(doc)
    server_section: dict[str, Any] = doc["server"]
    return server_section


def create_federation(root: Path, federation_id: str, task: str, config_text: str) -> Workspace:
    """Initialise the aggregator workspace under ``root/aggregator`` and enrol the
    operator's observer identity (``root/operator/identity.key``, 0600)."""
    ws = init_workspace(root / "aggregator", federation_id, task, config_text=config_text)
    _enrol(ws, root / OBSERVER_ID, OBSERVER_ID, "observer", ws.admin())
    return ws


def load_observer(root: Path) -> SigningIdentity:
    """The operator's observer identity of the federation created in ``root``.

    Raises:
        ConfigError: ``root`` was created before status requests were signed (it has
            no observer key), or the key file is unreadable.
    """
    path = root / OBSERVER_ID / "identity.key"
    if not path.exists():
        raise ConfigError(
            f"{root} has no observer key ({path}): it was created by an older fedsec, "
            "before GET /v1/status needed a signed request; create a new federation"
        )
    return load_identity(path)


def enrol_agents(ws: Workspace, root: Path, count: int, prefix: str = "agent") -> list[LocalAgent]:
    """Create ``count`` agent identities under ``root/<id>`` and add them to the roster."""
    admin = ws.admin()
    agents = []
    for i in range(count):
        agent_id = f"{prefix}-{i + 1}"
        home = root / agent_id
        agents.append(LocalAgent(agent_id, home, _enrol(ws, home, agent_id, "agent", admin)))
    return agents


def _enrol(
    ws: Workspace, home: Path, member_id: str, role: Role, admin: SigningIdentity
) -> SigningIdentity:
    """A new identity saved in ``home`` (key 0600, public key beside it), on the roster."""
    identity = SigningIdentity.generate()
    save_identity(identity, home / "identity.key")
    save_public_key(home / "identity.pub", identity.public_bytes)
    ws.roster.add(
        sign_roster_entry(
            federation_id=ws.federation_id,
            agent_id=member_id,
            public_key=identity.public_bytes,
            role=role,
            admin=admin,
        )
    )
    return identity


def agent_config(
    agent: LocalAgent,
    *,
    url: str,
    aggregator_public: bytes,
    task: str,
    part_index: int,
    parts: int,
    partition: str,
    seed: int,
    epsilon: float,
    delta: float = DEFAULT_DELTA,
    require_dp: bool = True,
    device: str = "auto",
    allow_distributed: bool = False,
) -> AgentConfig:
    """The agent.toml of one simulated data owner holding part ``part_index`` of a task."""
    return AgentConfig(
        agent=AgentSection(
            id=agent.agent_id,
            aggregator_url=url,
            aggregator_public_key=aggregator_public.hex(),
            state_dir=str(agent.root),  # holds identity.key, ledger, receipts, vault
            device=device,
        ),
        data=DataSection(
            task=task,
            dataset_id=f"{task}-part-{part_index}",
            partition=partition,
            part_index=part_index,
            parts=parts,
            seed=seed,
        ),
        privacy=PrivacySection(
            epsilon=epsilon,
            delta=delta,
            require_dp=require_dp,
            allow_distributed=allow_distributed,
        ),
        network=NetworkSection(retry_max=6, backoff_initial_s=0.2, backoff_max_s=2.0),
    )


def table_agent_config(
    agent: LocalAgent,
    *,
    url: str,
    aggregator_public: bytes,
    sources: list[SourceSpec],
    rules: ColumnRules,
    schema: DataSchema,
    epsilon: float,
    require_dp: bool = True,
) -> AgentConfig:
    """The agent.toml of a data owner training task ``table`` on its own ``sources``."""
    cfg = agent_config(
        agent,
        url=url,
        aggregator_public=aggregator_public,
        task="table",
        part_index=0,
        parts=1,
        partition="iid",
        seed=0,
        epsilon=epsilon,
        require_dp=require_dp,
    )
    data = DataSection(
        task="table",
        task_options=table_task_options(schema),
        dataset_id=f"{agent.agent_id}-records",
        sources=sources,
        rules=rules,
        schema=schema,
    )
    return msgspec.structs.replace(cfg, data=data)


def write_agent_config(agent: LocalAgent, cfg: AgentConfig) -> None:
    dump_agent_config(cfg, agent.config_path)
