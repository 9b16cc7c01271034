"""``peer.toml``: one member's settings for ``fedsec peer run``, validated at start-up.

An invalid file is refused with the key path and the reason (msgspec names the path,
e.g. ``$.topology.degree``).  See docs/decentralised.md for an example.
"""

from __future__ import annotations

import math
import ssl
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from fedsec.config import PrivacySection as AgentPrivacySection
from fedsec.crypto.identity import key_id
from fedsec.errors import ConfigError
from fedsec.peer.limits import (
    DEFAULT_EXCHANGES,
    DEFAULT_MAX_NORM_RATIO,
    DEFAULT_MIN_COSINE,
    DEFAULT_ROUND_TIMEOUT_S,
    DEFAULT_SEND_TIMEOUT_S,
    DEFAULT_STALENESS,
)
from fedsec.peer.topology import SignedTopology
from fedsec.protocol.limits import DEFAULT_DELTA, MAX_COHORT
from fedsec.protocol.roster import read_roster_document


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class MemberEntry(_Section, frozen=True, kw_only=True):
    public_key: str  # hex Ed25519
    url: str  # where its peer endpoint listens


class GossipSection(_Section, frozen=True, kw_only=True):
    robust: bool = True
    min_cosine: float = DEFAULT_MIN_COSINE
    reference: Literal["median", "own"] = "median"
    staleness: int = DEFAULT_STALENESS
    exchanges: int = DEFAULT_EXCHANGES
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S


class TrainingSection(_Section, frozen=True, kw_only=True):
    """This member's data: its shard of a bundled task's training split (the data sources
    of ``fedsec agent`` are not wired to peers yet)."""

    task: str
    shard: int
    shards: int
    partition: str = "iid"
    seed: int = 0
    local_epochs: int = 0  # 0: the task's default
    noise_multiplier: float = 0.0  # DP-SGD noise; 0: trains without DP (simulation only)
    max_grad_norm: float = 1.0
    delta: float = DEFAULT_DELTA


class PrivacySection(_Section, frozen=True, kw_only=True):
    """The member's privacy budget for this shard, in the agent's ledger
    (:mod:`fedsec.peer.privacy`); ``delta`` is ``training.delta``."""

    epsilon: float = AgentPrivacySection().epsilon  # agent.toml's default
    #: refuse to train without DP-SGD (training.noise_multiplier = 0), as agent.toml's
    require_dp: bool = AgentPrivacySection().require_dp
    #: the ledger's name for this data; "": the agent's name for the same shard of a
    #: bundled task, ``task:partition:seed:shard/shards``, so both charge one budget
    dataset_id: str = ""


class PeerConfig(_Section, frozen=True, kw_only=True):
    federation_id: str
    key_file: str
    host: str = "127.0.0.1"
    port: int
    admin_public_key: str
    rounds: int
    topology: SignedTopology
    members: list[MemberEntry]
    training: TrainingSection
    gossip: GossipSection = GossipSection()
    privacy: PrivacySection = PrivacySection()
    journal_file: str = "peer-journal.jsonl"
    #: where the member's privacy ledger lives (the agent's ``privacy_ledger.json``);
    #: the agent's state_dir makes the peer and the agent spend one budget
    state_dir: str = "state"
    #: the admin-signed roster (``fedsec-roster/1``, as the aggregator keeps it): when
    #: set, ``members`` must be exactly its active agents; "" trusts ``members`` as listed
    roster_file: str = ""
    #: PEM certificate chain and key to serve the peer endpoint over TLS; both or neither
    tls_cert: str = ""
    tls_key: str = ""
    #: PEM CA bundle the peer trusts for its neighbours' https urls; "" the system's
    tls_ca: str = ""


def load_peer_config(path: Path) -> PeerConfig:
    """Read and validate ``path``.

    Raises:
        ConfigError: unreadable, not TOML, a key of the wrong type, missing or unknown,
            or a value out of range; the detail names the key path.
    """
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
        config = msgspec.convert(doc, PeerConfig)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    _check_ranges(path, config)
    return config


def _check_ranges(path: Path, config: PeerConfig) -> None:
    if not 3 <= len(config.members) <= MAX_COHORT:
        raise ConfigError(f"{path}: members: a gossip roster has 3..{MAX_COHORT} members")
    if config.rounds < 1 or not 0 < config.port < 65536:
        raise ConfigError(f"{path}: rounds must be ≥ 1 and port in 1..65535")
    if len({m.public_key for m in config.members}) != len(config.members):
        raise ConfigError(f"{path}: members: a public key is listed twice")
    if len({m.url for m in config.members}) != len(config.members):
        raise ConfigError(f"{path}: members: two members share a url")
    t = config.training
    if not 0 <= t.shard < t.shards or t.local_epochs < 0:
        raise ConfigError(f"{path}: training.shard must be in 0..shards − 1")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError(f"{path}: tls_cert and tls_key are set both or neither")
    p = config.privacy
    if not (p.epsilon > 0 and math.isfinite(p.epsilon)) or t.noise_multiplier < 0:
        raise ConfigError(f"{path}: privacy.epsilon must be > 0, training.noise_multiplier ≥ 0")
    g = config.gossip
    if not (g.round_timeout_s > 0 and g.send_timeout_s > 0):
        raise ConfigError(f"{path}: gossip timeouts must be positive")
    try:
        for m in config.members:
            bytes.fromhex(m.public_key)
        bytes.fromhex(config.admin_public_key)
    except ValueError:
        raise ConfigError(f"{path}: public keys are hex") from None


def dataset_id(config: PeerConfig) -> str:
    """The ledger's name for this member's data (``privacy.dataset_id``, or the agent's
    for the same shard of a bundled task)."""
    t = config.training
    if config.privacy.dataset_id:
        return config.privacy.dataset_id
    return f"{t.task}:{t.partition}:{t.seed}:{t.shard}/{t.shards}"


def member_keys(config: PeerConfig, home: Path) -> dict[str, bytes]:
    """Each member's key id -> public key; with ``roster_file``, once the members are
    checked to be exactly the signed roster's active agents.

    Raises:
        ConfigError: the roster file cannot be read, or a member is not an active agent
            of it, or an active agent is not among the members.
        IntegrityError, SignatureError: the roster file's document or an entry's admin
            signature does not hold (:func:`fedsec.protocol.roster.read_roster_document`).
    """
    keys = {
        key_id(bytes.fromhex(m.public_key)): bytes.fromhex(m.public_key) for m in config.members
    }
    if not config.roster_file:
        return keys
    path = home / config.roster_file
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"roster_file: {exc}") from None
    admin = bytes.fromhex(config.admin_public_key)
    doc = read_roster_document(raw, admin, config.federation_id, str(path))
    agents = {e.key_id for e in doc.entries if e.is_active and e.role == "agent"}
    if outside := sorted(keys.keys() - agents):
        raise ConfigError(f"members: {outside[0]} is not an active agent of the signed roster")
    if unlisted := sorted(agents - keys.keys()):
        raise ConfigError(f"members: the signed roster's agent {unlisted[0]} has no url here")
    return keys


def tls_contexts(
    config: PeerConfig, home: Path
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The server context (None: plain HTTP) and the client context (None: aiohttp's
    default, the system's trust store) of ``config``.

    Raises:
        ConfigError: a certificate, key or CA file that cannot be loaded.
    """
    server = client = None
    try:
        if config.tls_cert:
            server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server.load_cert_chain(home / config.tls_cert, home / config.tls_key)
        if config.tls_ca:
            client = ssl.create_default_context(cafile=home / config.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls: {exc}") from None
    return server, client
