"""A federation workspace on disk: config, keys, roster, models and state database.

Layout::

    federation.toml      configuration (docs/config.md)
    aggregator.key/.pub  the aggregator's signing key (specs, manifests, receipts)
    admin.key/.pub       the admin key that signs roster entries (keep it offline)
    roster.json          admin-signed roster
    models/ manifests/   content-addressed model files and signed manifests
    state.db             SQLite state (WAL), unless [storage] url names a PostgreSQL
                         database (docs/deployment.md)
    he/context.json      secure_sum = "he": the key custodian's public CKKS context and
                         its signed statement (wire.HeContext), once published
    dp-verdict.json      the task whose model last passed Opacus's check (pin, options,
                         versions; fedsec.task.dp_verdict), so serving need not import Opacus
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fedsec.aggregator.storage import StateStore
from fedsec.aggregator.storage.models import ModelStore
from fedsec.aggregator.storage.roster_file import Roster
from fedsec.aggregator.storage.sqlite import SqliteStateStore
from fedsec.config import (
    FederationConfig,
    default_federation_toml,
    load_federation_config,
    parse_federation_config,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError
from fedsec.keys import load_identity, load_public_key, save_identity, save_public_key
from fedsec.summation import mode_named
from fedsec.task import Task, load_task
from fedsec.task.dp_verdict import ensure_checked, record_passed
from fedsec.tasks import get_task
from fedsec.tasks.params import state_to_arrays

CONFIG_FILE = "federation.toml"
AGGREGATOR_KEY = "aggregator.key"
ADMIN_KEY = "admin.key"
STATE_DB = "state.db"
HE_CONTEXT_FILE = "he/context.json"
DP_VERDICT_FILE = "dp-verdict.json"


@dataclass
class Workspace:
    """An opened workspace: where the concrete stores are chosen and opened; everything
    above uses ``state`` through the :mod:`fedsec.aggregator.storage` interfaces."""

    root: Path
    config: FederationConfig
    signer: SigningIdentity
    admin_public: bytes
    roster: Roster
    models: ModelStore
    state: StateStore

    @property
    def federation_id(self) -> str:
        return self.config.federation.id

    @classmethod
    def open(cls, root: Path, *, lead: bool = True) -> Workspace:
        """Open an initialised workspace (``lead``: take the PostgreSQL store's leader
        lease if nobody holds it; a group server opens it with False).

        Raises:
            ConfigError: not a workspace, or an invalid federation.toml.
        """
        root = Path(root)
        if not (root / CONFIG_FILE).exists():
            raise ConfigError(
                f"{root} is not a federation workspace (no {CONFIG_FILE}); "
                "run: fedsec aggregator init"
            )
        config = load_federation_config(root / CONFIG_FILE)
        signer = load_identity(root / AGGREGATOR_KEY)
        admin_public = load_public_key(root / "admin.pub")
        fid = config.federation.id
        return cls(
            root=root,
            config=config,
            signer=signer,
            admin_public=admin_public,
            roster=Roster(root, fid, admin_public),
            models=ModelStore(root, signer, fid),
            state=open_state(root, config, lead=lead),
        )

    @property
    def he_context_path(self) -> Path:
        """Where the published public CKKS context is kept (``secure_sum = "he"``)."""
        return self.root / HE_CONTEXT_FILE

    def admin(self) -> SigningIdentity:
        """The admin signing key (only where it is kept beside the workspace)."""
        return load_identity(self.root / ADMIN_KEY)

    def served_task(self) -> Task:
        """The federation's task, refused if Opacus cannot train its model: checked at
        init, and again (in a child process, so a serving aggregator never imports
        Opacus) only if the task package, its options or the validator changed since.

        Raises:
            DpIncompatibleModel: a layer Opacus refuses; the message names it and its fix.
            UnknownTask, ConfigError, InvalidTask: the task cannot be loaded or checked.
        """
        fed = self.config.federation
        task = load_task(fed.task, **fed.task_options)
        ensure_checked(task, self.root / DP_VERDICT_FILE)
        return task

    def close(self) -> None:
        self.state.close()


def open_state(root: Path, config: FederationConfig, *, lead: bool = True) -> StateStore:
    """The state store ``config`` names: SQLite in ``root`` by default, PostgreSQL when
    ``[storage] url`` is set (psycopg is imported only then, so an embedded deployment
    does not need it), holding the leader lease if no other replica does (and ``lead``).

    Raises:
        ConfigError: the PostgreSQL database cannot be reached or opened.
    """
    if not config.storage.url:
        return SqliteStateStore(root / STATE_DB)
    import psycopg  # only a PostgreSQL deployment needs the driver

    from fedsec.aggregator.storage.postgres import PostgresStateStore

    try:
        store = PostgresStateStore(config.storage.url)
        # leads unless another replica's lease is live; then every write is refused
        # (NotLeader) until this one takes the lease over
        if lead and store.lease.acquire(time.time()):
            store.lease.keep()
        return store
    except (psycopg.Error, ValueError) as exc:
        # libpq's messages name host and port, never the password
        raise ConfigError(
            f"storage.url: cannot open the PostgreSQL state database: {exc}"
        ) from None


def check_model_size(config: FederationConfig, params: int) -> None:
    """Refuse a task model the federation's summation mode cannot sum (e.g. homomorphic
    summation of a model whose encrypted update exceeds ``server.max_body_bytes``).

    Raises:
        ConfigError: the mode's sentences, naming the size and the bytes it would take.
    """
    problems = mode_named(config.round.secure_sum).model_problems(config, params)
    if problems:
        raise ConfigError("; ".join(problems))


def init_workspace(
    root: Path,
    federation_id: str,
    task: str = "breast_cancer",
    config_text: str | None = None,
    model_seed: int = 0,
) -> Workspace:
    """Create a workspace: keys (0600), config, empty roster, initial model version 1.

    Raises:
        ConfigError: the directory already holds a workspace, the config is invalid, or
            the summation mode cannot sum the task's model (:func:`check_model_size`);
            nothing is written then.
    """
    root = Path(root)
    if (root / CONFIG_FILE).exists():
        raise ConfigError(f"{root} already holds a federation workspace")
    text = config_text if config_text is not None else default_federation_toml(federation_id, task)
    config = parse_federation_config(text, str(root / CONFIG_FILE))
    # the task and its model are checked before anything is written
    the_task = get_task(config.federation.task, **config.federation.task_options)
    initial = the_task.build_model(seed=model_seed)
    check_model_size(config, sum(p.numel() for p in initial.parameters() if p.requires_grad))
    root.mkdir(parents=True, exist_ok=True)
    record_passed(the_task, root / DP_VERDICT_FILE)  # get_task checked it
    signer = SigningIdentity.generate()
    admin = SigningIdentity.generate()
    save_identity(signer, root / AGGREGATOR_KEY)
    save_identity(admin, root / ADMIN_KEY)
    save_public_key(root / "aggregator.pub", signer.public_bytes)
    save_public_key(root / "admin.pub", admin.public_bytes)
    models = ModelStore(root, signer, config.federation.id)
    models.put(
        state_to_arrays(initial),
        parent=None,
        round=None,
        kind="initial",
        metrics={},
        note=f"initial {the_task.name} v{the_task.version} model, seed {model_seed}",
    )
    (root / CONFIG_FILE).write_text(text)
    return Workspace.open(root)
