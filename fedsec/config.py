"""Configuration files: ``federation.toml`` (aggregator) and ``agent.toml`` (data owner).

Each file is parsed with :mod:`tomllib` and validated into frozen msgspec Structs that
refuse unknown keys.  Every key is documented by the docstring right below its field,
saying why its default is that value; :func:`key_docs` reads them, and the same sentences are
written into generated files (:func:`dump_federation_config`,
:func:`default_federation_toml`) and into ``docs/config.md``.  A bad file is refused
with a :class:`~fedsec.errors.ConfigError` naming the file, the key path and the
reason, e.g. ``federation.toml: round.quant_bits: expected an integer in 2..16, got 40``.

Relative paths in a file (``agent.state_dir``, ``data.csv``, ``server.tls_cert``,
``server.tls_key``) are resolved against the directory holding that file, so a
configuration means the same thing whatever directory a service is started from.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import ipaddress
import itertools
import math
import re
import tomllib
import typing
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from fedsec.crypto.secagg.graph import DEFAULT_TOLERATED_CORRUPT, default_threshold
from fedsec.data.settings import ColumnRules, SourceSpec
from fedsec.errors import ConfigError
from fedsec.fsio import atomic_write
from fedsec.learning import robust, worker_settings
from fedsec.protocol import compat, wire
from fedsec.protocol.data_schema import DataSchema
from fedsec.protocol.ddp import DEFAULT_MIN_SURVIVORS
from fedsec.protocol.limits import DEFAULT_DELTA, MAX_COHORT
from fedsec.protocol.ring_width import MAX_HEADROOM_BITS, weight_digit_bits
from fedsec.protocol.roster import ID_PATTERN
from fedsec.summation import mode_named
from fedsec.summation.sharded import shard_problems

_HEX_KEY = re.compile(r"^[0-9a-fA-F]{64}$")
_PARTITION = re.compile(r"^(iid|dirichlet:(?P<alpha>[0-9.eE+-]+))$")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")

MiB = 1024 * 1024

# -- federation.toml -----------------------------------------------------------------


class FederationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: str
    """Names the federation; bound into every signature so messages of one federation can never
    be replayed in another."""
    task: str = "breast_cancer"
    """Bundled task (model + data loader) every member trains; breast_cancer is small enough to
    run anywhere."""
    task_options: dict[str, Any] = {}
    """Task-specific options passed to the task (e.g. hidden layer sizes); empty means the task's
    own defaults."""


class RoundSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    min_agents: int = 3
    """Fewest members a round may close with. Secure summation reveals only a sum: with 2 members
    each could subtract its own update and learn the other's, so 3."""
    max_agents: int = 100
    """Largest cohort per round; bounds the aggregator's per-round work (key lists, shares) and
    memory."""
    rounds: int = 10
    """Rounds to run before the federation stops; 10 is a short first run on the bundled tasks,
    raise it for real ones."""
    neighbors: int = 0
    """SecAgg+ neighbours k per member; 0 = auto (the coordinator picks O(log n) from the cohort
    size; n-1, classic SecAgg, for small cohorts)."""
    threshold: int = 0
    """Shamir threshold t (shares needed to unmask); 0 = auto. The coordinator never goes below
    ⌊(d + 1)/2⌋ + 1 for a member's d neighbours: members refuse a smaller one, which an
    aggregator and one colluding neighbour could get around by telling neighbours different
    survivor sets (docs/threat-model.md)."""
    quant_bits: int = 8
    """Bits per coordinate after stochastic rounding (2..16); 8 bits is a quarter of float32's
    size with rounding error well below typical DP noise."""
    clip_norm: float = 1.0
    """L2 bound C on each member's update; caps any one member's influence and fixes the
    quantisation range."""
    secure_sum: Literal["secagg", "none", "he"] = "secagg"
    """secagg = SecAgg+ masking (the aggregator learns only the sum); he = homomorphic summation
    (CKKS, TenSEAL): the aggregator adds ciphertexts and a key custodian decrypts only their
    sum; none = trusted aggregator, plain signed updates."""
    mode: Literal["sync", "buffered"] = "sync"
    """sync = rounds with a cohort and stage deadlines; buffered = FedBuff asynchronous intake
    closing every buffer_size contributions."""
    buffer_size: int = 10
    """Contributions per aggregate in buffered mode; 10 balances freshness against the
    per-aggregate overhead."""
    max_staleness: int = 4
    """Buffered mode refuses updates trained on a model more than this many versions old; 4 keeps
    stale gradients from dragging the model back."""
    open_s: float = 600.0
    """Seconds members have to train once the cohort is fixed (added to the masked-input
    deadline); 600 is generous for one local epoch of a small task on a CPU."""
    advertise_s: float = 30.0
    """Seconds to upload signed ephemeral keys; a few requests, 30 s tolerates slow links."""
    share_s: float = 30.0
    """Seconds to upload encrypted Shamir shares; 30 s as for advertise."""
    masked_s: float = 60.0
    """Seconds to upload the masked update; 60 s allows a model-sized upload on a slow link."""
    unmask_s: float = 30.0
    """Seconds for survivors to return shares for unmasking; 30 s. The stage closes earlier once
    the answers decide the sum."""
    decrypt_s: float = 60.0
    """Seconds the key custodian has to decrypt a homomorphic sum once the masked-input stage
    closed (secure_sum = he); 60 s re-adds and decrypts a 1M-parameter sum of a hundred
    members with room to spare."""
    max_weight_samples: int = 10000
    """Sample count at which a member's weight w reaches 1.0 (w = min(1, samples / this)); caps
    the pull of one very large member."""
    shards: int = 1
    """Groups each round's cohort is split into, each summed by its own SecAgg+ session whose
    ring sums the aggregator adds (the model is that of one session); 1 = one session. The
    split comes from the round's signed seed and members check it; each group's sum is revealed
    to the aggregator (docs/threat-model.md, docs/privacy.md). secure_sum = "secagg" only."""
    min_shard_members: int = 100
    """Fewest members a group may hold when shards > 1: each group's sum is revealed, so it must
    be a sum of many (Bonawitz et al. 2019 sum groups of hundreds); round.min_agents must be at
    least shards x this."""
    shard_workers: bool = False
    """With shards > 1, each group's SecAgg+ session in a worker process of its own, so the
    groups unmask their dropped members' masks on as many cores; a worker that dies is started
    again and fed the group's messages. Off: every group in the aggregator's process."""
    group_servers: list[str] = msgspec.field(default_factory=list)
    """With shards > 1, base URLs of group server processes (fedsec aggregator group-serve, over
    the same state store) that take their groups' stage requests, dealt round-robin over the
    groups; the signed spec tells each member its group's URL. Empty: the leader takes every
    request (docs/deployment.md)."""


class TrainingSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    local_epochs: int = 1
    """Local passes over the member's data per round; 1 keeps the privacy cost per round low and
    limits client drift."""
    batch_size: int = 32
    """Records per DP-SGD batch; 32 suits the small bundled datasets."""
    lr: float = 0.05
    """Local learning rate; 0.05 is stable for the bundled tasks with SGD."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """Local optimiser (sgd or adam); sgd is the standard DP-SGD setting and needs the least
    tuning."""


class DPSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    """Train with DP-SGD (per-record clipping + Gaussian noise); on unless every member's data is
    public."""
    noise_multiplier: float = 1.0
    """Noise std / max_grad_norm; 1.0 is the common DP-SGD starting point; the accountant reports
    the epsilon it costs."""
    max_grad_norm: float = 1.0
    """Per-record gradient clipping bound; 1.0 is the usual DP-SGD default."""
    delta: float = DEFAULT_DELTA
    """DP delta; must be well below 1/records, 1e-5 suits datasets up to ~10^4 records."""
    mode: Literal["local", "distributed"] = "local"
    """local: every member adds all of its noise (holds against everyone). distributed: each
    member adds a share inside the SecAgg+ ring and only the sum carries the full noise;
    members must allow it (`privacy.allow_distributed`). docs/privacy.md."""
    unit: Literal["record", "member"] = "record"
    """distributed: record (each round is one DP-SGD step over the union of the members' records)
    or member (a member's whole clipped update, DP-FedAvg)."""
    sample_rate: float = 0.0
    """Distributed DP, record unit: each member's Poisson sampling rate q per round; the union's
    batch is q × all records."""
    min_survivors_fraction: float = 0.8
    """distributed: share of the cohort whose noise shares make the full noise; a round with
    fewer survivors is aborted before unmasking, and members refuse to unmask it. 0.8
    tolerates 20 % dropouts at 1/0.8 of the noise."""


class CodecSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rotation: Literal["none", "hadamard"] = "none"
    """A shared random rotation before rounding, so low bit widths lose little. Any compression
    (rotation, `keep` below 1, a range, headroom bits) is refused at load time with
    distributed DP, which discretises on its own terms, and with `secure_sum = "he"`, whose
    ciphertexts do not shrink with the bits."""
    keep: float = 1.0
    """Fraction of the model's coordinates each member sends: the same random subset for every
    member of a round, fresh every round."""
    range_stddevs: float = 0.0
    """A rotated coordinate's rounding range in standard deviations of a clipped update's
    coordinate; 0 = ±`round.clip_norm`. Coordinates beyond it are clamped and counted (members
    log `codec_saturated`); where updates sit well inside the clip a lower value pays
    (docs/compression.md)."""
    error_feedback: bool = False
    """Members add what the codec left out to their next update; refused with distributed DP
    (fedsec/protocol/compat.py)."""
    headroom_bits: int = 0
    """Ring bits above `round.quant_bits`; 0 = ⌈log₂ n⌉, in which no sum wraps (a cohort that
    needs no more than the value set gets that ring too). Fewer let a coordinate's sum over
    the cohort wrap: it is decoded centred, the weight travels as digits that cannot wrap, and
    sums in the ring's outer eighth are counted as likely wraps (`edge_count`, `wrap_rate` in
    `fedsec simulate`, the `ring_wrapped` alert). Each bit cut lets members send more
    coordinates in the same bytes (docs/compression.md)."""

    def spec(self) -> wire.CodecSpec:
        """The round spec's codec with these settings."""
        return wire.CodecSpec(**msgspec.structs.asdict(self))


class ServerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    """Address the aggregator listens on; loopback by default so nothing is exposed until the
    operator says so."""
    port: int = 8443
    """TCP port; 8443 is the conventional unprivileged HTTPS port."""
    advertise_url: str = ""
    """The URL members reach this aggregator at, which standby replicas name in their 503
    not_leader while it leads ([storage] url); empty = the URL it listens on, wrong behind a
    proxy, a NAT or a 0.0.0.0 listener."""
    max_body_bytes: int = 64 * MiB
    """Largest binary request body (models, masked vectors); 64 MiB holds a float32 model of just
    under 16M parameters."""
    max_json_bytes: int = 1 * MiB
    """Largest JSON control message; 1 MiB holds key lists and share bundles for cohorts in the
    hundreds."""
    clock_skew_s: float = 300.0
    """Request signatures older or newer than this are refused; 300 s is the usual window for
    unsynchronised clocks (as Kerberos)."""
    header_timeout_s: float = 10.0
    """A connection must deliver a request's complete headers within this many seconds of opening
    or, on a kept-alive connection, of the headers' first byte, else it is closed; 10 s is ample
    for a few hundred bytes on any link and bounds connections held by dribbled headers."""
    keepalive_s: float = 75.0
    """A kept-alive connection sending nothing is closed after this many idle seconds. Members
    come back between stages, and each new connection is a TCP and TLS handshake; their client
    keeps an idle connection 55 s, so keep this above that. 75 s as nginx; idle connections are
    within max_connections' 3 per roster entry."""
    body_timeout_s: float = 120.0
    """A request body must arrive within this many seconds of its headers, else the request is
    refused (408) and the connection closed; 120 s carries a 64 MiB body over a 5 Mbit/s link."""
    max_connections: int = 0
    """Open connections at once; at the limit a new one displaces the oldest idle
    unauthenticated connection, else the oldest idle kept-alive one, or is closed on accept if
    every connection has a request in progress. 0 sizes it from the
    roster at start-up: 3 per roster entry (a long poll, a request, one closing) + 256 for
    dashboards, scrapers and newcomers, so 1,000 members get 3,256. `aggregator serve`
    raises its own soft `RLIMIT_NOFILE` to the limit + 128 within the hard limit, and
    refuses to start, naming both numbers and `ulimit -n` / systemd `LimitNOFILE=`, when the
    hard limit is lower. A value set here is used as is (a WARNING
    `event=connection_limit_below_roster` when the roster needs more). Members added while
    serving fit within the 256 spare; restart after adding many."""
    max_connections_per_peer: int = 64
    """Unauthenticated connections one peer (an IPv4 address, an IPv6 /64) may hold open at once;
    more are closed on accept. A connection stops counting once it carries a signed request or
    an observer's token, so members behind one NAT are not held to it; 64 lets that many
    connect at the same instant, while a host with no key holds an eighth of the default
    max_connections. When max_connections are open, a new connection displaces the oldest idle
    unauthenticated one, so members always get in."""
    max_concurrent_uploads: int = 8
    """Authenticated binary bodies (larger than max_json_bytes) read at once; others wait for a
    slot, so request bodies in memory stay under this times max_body_bytes."""
    upload_queue_s: float = 30.0
    """How long an upload waits for a slot before it is answered 503 with Retry-After; 30 s rides
    out a round's burst of masked inputs."""
    member_rate_per_s: float = 50.0
    """Signed requests per second one member key may send, sustained (token bucket); an honest
    member sends about 10 per round, so 50/s is 5x a one-second round and no member can starve
    another. Over it: 429 with Retry-After."""
    member_burst: int = 300
    """Token-bucket depth of member_rate_per_s: requests one member may send at once after being
    idle; 300 covers catching up on many rounds' models."""
    optimizer: Literal["fedavg", "fedadam"] = "fedavg"
    """Server optimiser: fedavg applies the averaged update; fedadam applies it through Adam
    (Reddi et al. 2021). Unset, fedadam with record-level distributed DP (its sum is one
    noised DP-SGD step of the union's batch, which Adam's per-coordinate scaling steadies),
    else fedavg."""
    server_lr: float = 1.0
    """Server learning rate; 1.0 with fedavg is plain federated averaging. Unset with fedadam:
    0.03 with record-level distributed DP (the measured recipe, docs/privacy.md), else 0.01."""
    adam_beta1: float = 0.9
    """FedAdam first-moment decay; 0.9 as in Reddi et al."""
    adam_beta2: float = 0.99
    """FedAdam second-moment decay; 0.99 as in Reddi et al."""
    adam_tau: float = 1e-3
    """FedAdam adaptivity (epsilon); 1e-3 as in Reddi et al."""
    tls_cert: str = ""
    """PEM certificate for HTTPS; empty = plain HTTP (requests are still signed; use only behind
    a TLS-terminating proxy or on loopback)."""
    tls_key: str = ""
    """PEM private key matching tls_cert; set both or neither."""


class ValidationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    """Score each new global model on the aggregator's validation split; the scores feed the
    dashboard, /metrics and the degradation alert ([alerts])."""
    federated: bool = False
    """Members score each new global model on their own held-out split and send signed metric
    reports (sums, no per-record output); their pooled values then feed the dashboard, /metrics
    and the degradation alert instead of the aggregator's. For an aggregator that holds no data;
    needs a model the aggregator can read (not he.model_visible_to_aggregator = false)."""


class AuditSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    archive_retention_rounds: int = 0
    """Closed rounds whose archived protocol messages are kept; 0 = keep forever, so anyone
    holding the archive can re-run every aggregate. N keeps the newest N; older rounds are
    pruned under a signed archive_pruned log entry."""
    # a failed control-sample verdict quarantines its member at once (off: only on an
    # admin- or auditor-signed order, so a false positive costs no member by itself)
    quarantine_on_failure: bool = False
    """A failed control-sample verdict (POST /v1/audit/verdicts) quarantines its member at once:
    no future cohort, a quarantine log entry, a member_quarantined alert offering the rollback
    (docs/robustness.md). Off by default, so one false positive does not cost a member: then
    only an admin- or auditor-signed order does. Sound only where the per-round DP noise is in
    the checks' calibrated range (docs/robustness.md, measured)."""


class HeSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    custodian: str = ""
    """Roster id of the key custodian (role custodian) that holds the CKKS secret key; required
    with secure_sum = he. Name a party outside the operator's organisation: it sees the
    members' ciphertexts (to check each sum it decrypts), so it alone could read one update if
    it broke its rules; the aggregator alone never can."""
    poly_modulus_degree: int = 8192
    """CKKS ring degree N (4096, 8192 or 16384); 8192 packs 4096 values per ciphertext at 32
    bytes per parameter, the fewest bytes for sum-only use."""
    coeff_mod_bit_sizes: list[int] = msgspec.field(default_factory=lambda: [60, 60])
    """CKKS coefficient moduli in bits; [60, 60]: one 60-bit data prime (no rescaling is needed
    for additions) and the special prime, within SEAL's 128-bit security bound for N = 8192."""
    scale_bits: int = 40
    """CKKS scale 2^bits; 40 keeps the encryption error near 1e-8, far below one quantisation
    level, and leaves 19 bits of headroom under the 60-bit prime."""
    model_visible_to_aggregator: bool = True
    """true: the custodian releases the decrypted sum to the aggregator, which validates and
    publishes the model as in the other modes. false: the custodian derives each model and
    seals it to the members, auditors and itself; the aggregator stores it unread (no
    validation, fedavg only, sync rounds)."""


class AggregationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[aggregation]``: the robust rule of a trusted aggregator.  Its fields are
    ``wire.AggregationSpec``'s, which carries them in each signed spec; the ranges are
    ``fedsec.learning.robust.PARAMETERS``'."""

    rule: wire.AggregationRule = "fedavg"
    """How a trusted aggregator (round.secure_sum = none) combines the updates it sees one by
    one: fedavg (the weighted mean), trimmed_mean, median, multi_krum, centered_clipping, dnc
    or fltrust (docs/robustness.md). Refused in the secure modes, where the aggregator sees
    only the sum. fedavg: with no attackers it loses nothing."""
    trim_fraction: float = 0.1
    """trimmed_mean: share beta cut at each end of every coordinate, [0, 0.5); 0.1 withstands up
    to a tenth of the cohort poisoning any one coordinate."""
    byzantine: int = 1
    """multi_krum and dnc: members f assumed Byzantine; multi_krum needs round.min_agents >= 2f +
    3, dnc (which refuses f updates every round) >= 2f + 1. 1 suits the small cohorts of the
    bundled tasks."""
    krum_selected: int = 0
    """multi_krum: updates m averaged; 0 = n - f, Multi-Krum's usual choice (at most
    round.min_agents - byzantine)."""
    clip_radius: float = 0.5
    """centered_clipping: radius tau, the most one update pulls the centre per iteration; 0.5 is
    half the default clip_norm, so three iterations can reach any honest mean."""
    clip_iterations: int = 3
    """centered_clipping: passes from the zero update (1..100); 3, as Karimireddy et al. find 1-3
    enough."""
    root_records: int = 100
    """fltrust: records of the aggregator's root dataset, drawn once from the task's training
    split (never its validation split); about 100, as in FLTrust."""
    min_trust_score: float = 0.0
    """fltrust: refuse updates whose trust score (cosine with the aggregator's reference, clipped
    at 0) is below this, in [0, 1]; 0 refuses only updates that do not point the reference's
    way."""
    max_norm_ratio: float = 0.0
    """Any rule: refuse an update longer than this many times the median update's norm (>= 1); 0
    = off. A refused update is logged with the reason, never silently dropped."""


class AlertsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    stall_s: float = 900.0
    """Raise round_stalled when the attempt in progress has not changed stage for this many
    seconds; 900 s is past every default stage deadline (the longest, masked input, is open_s
    + masked_s = 660 s), so only a stuck round trips it."""
    degradation_window: int = 5
    """Validation degradation compares the newest model version with the best of the previous W
    scored versions; 5 rides out one noisy DP round."""
    accuracy_drop: float = 0.05
    """Raise validation_degraded when the task's primary metric (accuracy for classification)
    is more than this (absolute, 0.05 = 5 points) worse than the best of the window, in the
    metric's direction; DP noise moves accuracy 1-2 points."""
    loss_rise: float = 0.5
    """Also raise it when the loss rises more than this fraction above the lowest of the window
    (0.5 = 50 %); 0 turns the loss check off."""
    participation_min: float = 0.5
    """Raise participation_dropped when an attempt ends with fewer accepted contributions than
    this share of its cohort; 0.5 = half the cohort fell away."""
    wrap_rate_max: float = 0.005
    """Raise ring_wrapped when more than this share of a closed distributed-DP round's summed
    coordinates lay at the ring's edge (likely wrapped, so corrupted in the new model); 0.5 %:
    a ring at its sizing limit puts about 0.3 % there every round by design, one with room to
    spare (16 quant_bits in docs/privacy.md) none; 0 = any; 1 = off. It also watches rounds
    whose `codec.headroom_bits` let sums wrap, which count sums in the ring's outer eighth
    (docs/compression.md)."""
    refusals_per_member: int = 10
    """Raise member_refused when one member's contributions are refused this many times within
    refusals_window_s; an honest member meets one or two."""
    refusals_window_s: float = 600.0
    """The window of refusals_per_member, in seconds."""
    budget_fraction: float = 0.9
    """Raise member_near_budget when a member's reported epsilon reaches this share of its budget
    (declared in its signed report, else epsilon_budget)."""
    epsilon_budget: float = 0.0
    """Budget assumed for members whose reports declare none; 0 = only members that declare a
    budget are checked."""
    webhooks: list[str] = []
    """URLs each alert is POSTed to as JSON, signed with the aggregator's key (RFC 9421, like
    members' requests); empty = none. Delivery never blocks a round. https:// only (http:// to
    localhost or a loopback address): each delivery carries the capability that acknowledges
    its alert."""
    webhook_timeout_s: float = 5.0
    """Seconds one webhook delivery may take; 5 s."""
    webhook_attempts: int = 8
    """Deliveries tried per alert and URL before giving up (logged); 8 with the backoff below
    (1+2+4+8+16+32+60 s) spans about 2 minutes of receiver outage."""
    webhook_backoff_s: float = 1.0
    """Delay before the first retry; doubles per retry up to 60 s."""


class DashboardSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    """Serve the read-only operator dashboard at /dashboard."""
    loopback_open: bool = True
    """Let requests from loopback (127.0.0.1, ::1, with a loopback Host) see the dashboard
    without a token, for the operator on the aggregator's machine; turn off when a reverse
    proxy on the same machine forwards outside requests."""
    token_ttl_s: float = 8 * 3600.0
    """Default lifetime of a dashboard or scrape token issued by `fedsec aggregator
    dashboard-token`; 8 h, one working day."""
    push_interval_s: float = 1.0
    """Shortest interval between two live updates pushed to an open dashboard; 1 s is live to the
    eye and bounds the aggregator's cost per viewer."""


class MetricsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    access: Literal["loopback", "token", "open"] = "loopback"
    """Who may scrape /metrics: loopback (no token from 127.0.0.1/::1, a token otherwise), token
    (always a metrics-scope token) or open (anyone)."""
    member_labels: bool = True
    """Export per-member series (epsilon reported); turn off when member ids must not reach the
    monitoring system."""


class StorageSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    url: str = ""
    """Where the aggregator's state lives: empty for the embedded SQLite state.db in the
    workspace, or a postgresql:// URL shared by replicated aggregators (docs/deployment.md); keep
    the password out of it (libpq's PGPASSFILE or PGPASSWORD)."""


class FederationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything the aggregator needs to run a federation (``federation.toml``)."""

    federation: FederationSection
    round: RoundSection = msgspec.field(default_factory=RoundSection)
    training: TrainingSection = msgspec.field(default_factory=TrainingSection)
    dp: DPSection = msgspec.field(default_factory=DPSection)
    codec: CodecSection = msgspec.field(default_factory=CodecSection)
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    validation: ValidationSection = msgspec.field(default_factory=ValidationSection)
    audit: AuditSection = msgspec.field(default_factory=AuditSection)
    alerts: AlertsSection = msgspec.field(default_factory=AlertsSection)
    dashboard: DashboardSection = msgspec.field(default_factory=DashboardSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    storage: StorageSection = msgspec.field(default_factory=StorageSection)
    he: HeSection = msgspec.field(default_factory=HeSection)
    aggregation: AggregationSection = msgspec.field(default_factory=AggregationSection)
    schema: DataSchema | None = None  # task "table": the columns every member trains on


# -- agent.toml ------------------------------------------------------------------------


class AgentSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: str
    """This member's id in the roster; must match the id the admin enrolled."""
    aggregator_url: str | list[str]
    """Base URL of the aggregator (http:// or https://), or a list of the URLs of its replicas
    ([storage] url): the agent moves between them and follows a replica's not_leader answer
    only to a URL in this list."""
    aggregator_public_key: str
    """Aggregator's Ed25519 public key, 64 hex digits, from the operator; pins every model
    manifest and receipt to it."""
    state_dir: str = "state"
    """Where the agent keeps its key, privacy ledger and audit vault; relative to this file."""
    device: str = "auto"
    """Training device: auto (CUDA if present, else CPU), cpu, cuda, cuda:N or mps."""

    @property
    def aggregator_public_key_bytes(self) -> bytes:
        return bytes.fromhex(self.aggregator_public_key)


class DataSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: str = "breast_cancer"
    """Bundled task to train; must equal the federation's task."""
    task_options: dict[str, Any] = {}
    """Task-specific options; must match the federation's."""
    dataset_id: str = ""
    """Names this member's dataset in the privacy ledger (epsilon is tracked per dataset); empty
    = derived from task, partition and csv."""
    partition: str = "iid"
    """How the bundled dataset is split among demo members: iid, or dirichlet:ALPHA for label
    skew (smaller alpha = more skew)."""
    part_index: int = 0
    """Which part this member gets (0-based, < parts)."""
    parts: int = 1
    """Number of parts the bundled dataset is split into (1 = all of it)."""
    seed: int = 0
    """Seed of the split, so every member computes the same partition."""
    csv: str = ""
    """CSV file with this member's own records instead of the bundled data; relative to this
    file; empty = bundled data."""
    # task "table": the owner's stores, its column rules, and the federation's [schema]
    sources: list[SourceSpec] = []
    """Task `table`: the owner's stores, entries of kind `csv`, `parquet` or `sql` (SQLAlchemy
    `url` + `query`, or a `password_file` of mode 0600); see [data.md](data.md). A url holding
    a password makes this file refuse to load unless its mode is 0600."""
    rules: ColumnRules | None = None
    """Task `table`: this member's column rules (`rename`, `exclude`, `anonymise`, `units`,
    `impute`, `hash_key_file`); see [data.md](data.md)."""
    schema: DataSchema | None = None
    """Task `table`: a copy of the federation's `[schema]`; the agent checks its data against it
    before anything is sent."""
    summary_epsilon: float = 0.0
    """Task `table`: epsilon of Laplace noise on the counts of the data summary sent at join,
    charged to the privacy ledger once per agent start; 0 = exact counts (aggregate
    statistics, no noise, nothing charged)."""

    def effective_dataset_id(self) -> str:
        """``dataset_id``, or one derived from where the data comes from."""
        if self.dataset_id:
            return self.dataset_id
        if self.csv:
            return f"csv:{Path(self.csv).name}"
        if self.sources:
            # files by name, queries by a digest of the query: never the URL, which may
            # hold credentials, and the ledger's name survives a moved file or a new host
            return "table:" + "+".join(
                Path(s.path).name
                if s.path
                else "sql-" + hashlib.sha256(s.query.encode()).hexdigest()[:12]
                for s in self.sources
            )
        return f"{self.task}:{self.partition}:{self.seed}:{self.part_index}/{self.parts}"

    def dirichlet_alpha(self) -> float | None:
        """The Dirichlet concentration of a ``dirichlet:ALPHA`` partition, else None."""
        match = _PARTITION.fullmatch(self.partition)
        if match and match.group("alpha") is not None:
            return float(match.group("alpha"))
        return None


class PrivacySection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    epsilon: float = 8.0
    """Total epsilon this member will spend on this dataset across all rounds; training stops
    past it. 8 is a common upper bound for useful DP models."""
    delta: float = DEFAULT_DELTA
    """DP delta for the ledger; must be well below 1/records."""
    require_dp: bool = True
    """Refuse rounds that ask for training without DP-SGD; turn off only for simulations on
    public data, never for real records."""
    allow_distributed: bool = False
    """Take part in distributed-DP rounds, where this member adds only a share of the noise and
    the guarantee rests on the other members adding theirs; off, because that trust is the
    data owner's decision (docs/privacy.md)."""
    # distributed DP: the fewest survivors a round's noise may be sized for (its
    # dp.min_survivors); each adds 1/min_survivors of the noise (fedsec.protocol.ddp)
    min_survivors: int = DEFAULT_MIN_SURVIVORS
    """Distributed DP: refuse, before training, a round whose noise is sized for fewer survivors
    (its `dp.min_survivors`), naming both numbers. Each member adds 1/`dp.min_survivors` of
    the noise's variance, which a member colluding with the aggregator (it knows its own
    share) can remove: 2 is the smallest sum and lets one colluder remove half; 10 lets one
    remove at most 10 %. docs/privacy.md."""
    # γ: colluding neighbours (with the aggregator) a SecAgg+ round must withstand; the
    # member refuses a threshold with 2t ≤ degree + γ (fedsec.crypto.secagg.graph)
    tolerated_corrupt_neighbours: int = DEFAULT_TOLERATED_CORRUPT
    """SecAgg+: γ, members colluding with the aggregator against which this member's update must
    stay hidden; it refuses a round whose threshold t has 2t ≤ d + γ for the most neighbours d
    any member has (the equivocation bound, docs/threat-model.md)."""


class AgentTrainingSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    workers: int = 1
    """Processes the round's local training runs as, one torchrun job of DDP workers (gloo on
    CPUs, NCCL with one per GPU); 1 = in the agent as before, 0 = one per GPU (in-process
    without CUDA). With DP-SGD, the single process's mechanism and ε (Poisson sampling
    across shards, noise once on rank 0); docs/agent.md."""
    max_restarts: int = worker_settings.DEFAULT_MAX_RESTARTS
    """torchrun restarts of a round's job after a worker dies; 2: a worker lost twice in one
    round points at a broken node, and the next round starts fresh."""
    checkpoint_steps: int = worker_settings.DEFAULT_CHECKPOINT_STEPS
    """Steps between the job's checkpoints in the state directory, which a restarted job
    resumes from; 0 = none (a restart trains the round again from its start)."""
    checkpoint_interval_s: float = worker_settings.DEFAULT_CHECKPOINT_INTERVAL_S
    """Seconds between the job's checkpoints as well, whichever of steps or seconds comes
    first; 60 keeps a rollback to a minute of a round's 600 s; 0 = by steps only."""
    straggler_timeout_s: float = worker_settings.DEFAULT_STRAGGLER_TIMEOUT_S
    """Seconds a worker may keep the others waiting at a step's all-reduce before the job
    restarts every worker from its last checkpoint; 60 is far above a step's imbalance and
    far below a round's 600 s; docs/agent.md."""
    nodes: int = 1
    """Machines of the member's cluster a round's job spans, each running `workers`
    processes; 1 = this one. Node 0 is the agent's; the others run `fedsec agent
    train-node` with the same file but their own `node_rank`; docs/agent.md."""
    node_rank: int = 0
    """This machine's place in the job: 0 = the agent's node, which holds rank 0 (it alone
    talks to the aggregator); 1..nodes-1 = a node running `fedsec agent train-node`."""
    rendezvous_endpoint: str = ""
    """host:port on node 0 where the nodes meet (torchrun's static rendezvous), inside the
    member's perimeter, never the aggregator's network; needed when nodes > 1."""

    @property
    def settings(self) -> worker_settings.TrainingWorkers:
        return worker_settings.TrainingWorkers(
            self.workers,
            self.max_restarts,
            self.checkpoint_steps,
            self.checkpoint_interval_s,
            self.straggler_timeout_s,
            self.nodes,
            self.node_rank,
            self.rendezvous_endpoint,
        )


class NetworkSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    retry_max: int = 8
    """Retries of a failed request before giving up on the stage; 8 spans about 45 s of outage
    with the backoff below (0.5+1+2+4+8+10+10+10)."""
    backoff_initial_s: float = 0.5
    """First retry delay; doubles per retry up to backoff_max_s."""
    backoff_max_s: float = 10.0
    """Longest retry delay; 10 s keeps a member inside stage deadlines of 30 s."""
    timeout_s: float = 30.0
    """Per-request timeout; 30 s allows a model download on a slow link."""


class AgentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything a data owner's agent needs (``agent.toml``)."""

    agent: AgentSection
    data: DataSection = msgspec.field(default_factory=DataSection)
    privacy: PrivacySection = msgspec.field(default_factory=PrivacySection)
    network: NetworkSection = msgspec.field(default_factory=NetworkSection)
    training: AgentTrainingSection = msgspec.field(default_factory=AgentTrainingSection)


@functools.cache
def key_docs() -> Mapping[str, str]:
    """Key path -> why its default is what it is: the docstring right below each field of
    ``federation.toml`` and ``agent.toml`` (the one place a key is documented), written as
    comments into generated files and as the meaning column of ``docs/config.md``.

    Read from the sections' source on first use, not at import.
    """
    docs: dict[str, str] = {}
    for kind in (FederationConfig, AgentConfig):
        for section in msgspec.structs.fields(kind):
            # an optional section (X | None) is documented as X
            cls = next(
                (t for t in typing.get_args(section.type) if t is not type(None)), section.type
            )
            docs.update({f"{section.name}.{k}": v for k, v in _field_docs(cls).items()})
    return docs


def _field_docs(section: type) -> dict[str, str]:
    """Each field of class ``section`` with the docstring right below it (whitespace
    folded)."""
    tree = _module_tree(inspect.getsourcefile(section) or "")
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == section.__name__)
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


@functools.cache
def _module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


# -- validation --------------------------------------------------------------------------


class _Problems:
    """Collects ``key: expected ..., got ...`` sentences."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def require(self, ok: bool, path: str, expected: str, got: object) -> None:
        if not ok:
            self.items.append(f"{path}: expected {expected}, got {_show(got)}")

    def fail(self, path: str, sentence: str) -> None:
        self.items.append(f"{path}: {sentence}")

    def int_range(self, path: str, value: int, lo: int, hi: int | None = None) -> None:
        if hi is None:
            self.require(value >= lo, path, f"an integer >= {lo}", value)
        else:
            self.require(lo <= value <= hi, path, f"an integer in {lo}..{hi}", value)

    def positive(self, path: str, value: float) -> None:
        self.require(math.isfinite(value) and value > 0, path, "a number > 0", value)

    def open_unit(self, path: str, value: float, *, zero_ok: bool = False) -> None:
        ok = (0 <= value < 1) if zero_ok else (0 < value < 1)
        self.require(ok, path, "a number in [0, 1)" if zero_ok else "a number in (0, 1)", value)

    def identifier(self, path: str, value: str) -> None:
        self.require(
            bool(ID_PATTERN.fullmatch(value)),
            path,
            "1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit",
            value,
        )


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _validate_federation(cfg: FederationConfig) -> list[str]:
    p = _Problems()
    p.identifier("federation.id", cfg.federation.id)
    p.items.extend(_table_problems("federation", cfg.federation.task, cfg.schema))
    p.require(bool(cfg.federation.task), "federation.task", "a task name", cfg.federation.task)
    r = cfg.round
    least = compat.traits(r.secure_sum).min_contributors
    p.int_range("round.min_agents", r.min_agents, least, MAX_COHORT)
    p.int_range("round.max_agents", r.max_agents, max(r.min_agents, 1), MAX_COHORT)
    p.int_range("round.rounds", r.rounds, 1)
    if r.neighbors:
        p.int_range("round.neighbors", r.neighbors, 2, max(r.max_agents - 1, 2))
    if r.threshold:
        upper = r.neighbors + 1 if r.neighbors else r.max_agents
        # the most neighbours a member can get with these k (one more for odd n·k)
        degree = r.neighbors + r.neighbors % 2 if r.neighbors else 0
        floor = min(default_threshold(degree), r.neighbors) if r.neighbors else 2
        p.int_range("round.threshold", r.threshold, max(floor, 2), max(upper, 2))
    p.int_range("round.quant_bits", r.quant_bits, 2, 16)
    p.positive("round.clip_norm", r.clip_norm)
    p.int_range("round.buffer_size", r.buffer_size, 1, 100_000)
    p.int_range("round.max_staleness", r.max_staleness, 0)
    for name in ("open_s", "advertise_s", "share_s", "masked_s", "unmask_s", "decrypt_s"):
        p.positive(f"round.{name}", getattr(r, name))
    p.int_range("round.max_weight_samples", r.max_weight_samples, 1)
    t = cfg.training
    p.int_range("training.local_epochs", t.local_epochs, 1, 1000)
    p.int_range("training.batch_size", t.batch_size, 1)
    p.positive("training.lr", t.lr)
    d = cfg.dp
    if d.enabled:
        p.positive("dp.noise_multiplier", d.noise_multiplier)
    else:
        p.require(
            d.noise_multiplier >= 0, "dp.noise_multiplier", "a number >= 0", d.noise_multiplier
        )
    p.positive("dp.max_grad_norm", d.max_grad_norm)
    p.open_unit("dp.delta", d.delta)
    if d.mode == "distributed":
        p.require(d.enabled, "dp.mode", "dp.enabled = true for distributed DP", d.enabled)
        if d.unit == "record":
            p.require(0 < d.sample_rate <= 1, "dp.sample_rate", "a rate in (0, 1]", d.sample_rate)
        p.require(
            0 < d.min_survivors_fraction <= 1,
            "dp.min_survivors_fraction",
            "a share of the cohort in (0, 1]",
            d.min_survivors_fraction,
        )
    c = cfg.codec
    p.require(0 < c.keep <= 1, "codec.keep", "a fraction in (0, 1]", c.keep)
    p.require(c.range_stddevs >= 0, "codec.range_stddevs", "a number >= 0", c.range_stddevs)
    if c.range_stddevs:
        p.require(
            c.rotation == "hadamard",
            "codec.range_stddevs",
            "codec.rotation = 'hadamard'",
            c.rotation,
        )
    p.int_range("codec.headroom_bits", c.headroom_bits, 0, MAX_HEADROOM_BITS)
    if 0 < c.headroom_bits <= MAX_HEADROOM_BITS and cfg.round.quant_bits > 0:
        p.require(
            c.rotation == "hadamard",
            "codec.headroom_bits",
            "codec.rotation = 'hadamard'",
            c.rotation,
        )
        bits = cfg.round.quant_bits
        p.require(
            weight_digit_bits(max(cfg.round.max_agents, 1), bits, bits + c.headroom_bits) >= 1,
            "codec.headroom_bits",
            f"a ring of quant_bits + headroom_bits bits that holds the weights of "
            f"round.max_agents = {cfg.round.max_agents} members",
            c.headroom_bits,
        )
    p.require(
        not (cfg.validation.federated and not cfg.he.model_visible_to_aggregator),
        "validation.federated",
        "false while he.model_visible_to_aggregator = false (members evaluate the published "
        "model, which is then sealed)",
        cfg.validation.federated,
    )
    # the same refusals as the round's spec (fedsec.protocol.compat.check_spec), at load
    # time, so such a federation never opens a round that cannot close
    for conflict in compat.conflicts(_features(cfg)):
        p.fail(conflict.key, conflict.reason)
    s = cfg.server
    p.require(bool(s.host), "server.host", "a host name or address", s.host)
    p.int_range("server.port", s.port, 0, 65535)
    p.require(
        not s.advertise_url or _is_http_url(s.advertise_url),
        "server.advertise_url",
        "empty or an http:// or https:// URL",
        s.advertise_url,
    )
    p.int_range("server.max_body_bytes", s.max_body_bytes, 1024)
    p.int_range("server.max_json_bytes", s.max_json_bytes, 1024, max(s.max_body_bytes, 1024))
    p.positive("server.clock_skew_s", s.clock_skew_s)
    p.positive("server.header_timeout_s", s.header_timeout_s)
    p.positive("server.keepalive_s", s.keepalive_s)
    p.positive("server.body_timeout_s", s.body_timeout_s)
    p.int_range("server.max_connections", s.max_connections, 0)
    p.int_range("server.max_connections_per_peer", s.max_connections_per_peer, 1)
    p.int_range("server.max_concurrent_uploads", s.max_concurrent_uploads, 1)
    p.positive("server.upload_queue_s", s.upload_queue_s)
    p.positive("server.member_rate_per_s", s.member_rate_per_s)
    p.int_range("server.member_burst", s.member_burst, 1)
    p.positive("server.server_lr", s.server_lr)
    p.open_unit("server.adam_beta1", s.adam_beta1, zero_ok=True)
    p.open_unit("server.adam_beta2", s.adam_beta2, zero_ok=True)
    p.positive("server.adam_tau", s.adam_tau)
    if bool(s.tls_cert) != bool(s.tls_key):
        missing = "server.tls_key" if s.tls_cert else "server.tls_cert"
        p.fail(missing, "must be set when the other of tls_cert/tls_key is set")
    p.int_range("audit.archive_retention_rounds", cfg.audit.archive_retention_rounds, 0)
    # the mode's own settings ([he] for homomorphic summation)
    p.items.extend(mode_named(r.secure_sum).config_problems(cfg))
    p.items.extend(shard_problems(cfg))
    al = cfg.alerts
    p.positive("alerts.stall_s", al.stall_s)
    p.int_range("alerts.degradation_window", al.degradation_window, 1, 1000)
    p.require(
        0 < al.accuracy_drop <= 1, "alerts.accuracy_drop", "a number in (0, 1]", al.accuracy_drop
    )
    p.require(
        math.isfinite(al.loss_rise) and al.loss_rise >= 0,
        "alerts.loss_rise",
        "a number >= 0",
        al.loss_rise,
    )
    p.require(
        0 <= al.participation_min <= 1,
        "alerts.participation_min",
        "a number in [0, 1]",
        al.participation_min,
    )
    p.require(
        0 <= al.wrap_rate_max <= 1,
        "alerts.wrap_rate_max",
        "a number in [0, 1]",
        al.wrap_rate_max,
    )
    p.int_range("alerts.refusals_per_member", al.refusals_per_member, 1)
    p.positive("alerts.refusals_window_s", al.refusals_window_s)
    p.require(
        0 < al.budget_fraction <= 1,
        "alerts.budget_fraction",
        "a number in (0, 1]",
        al.budget_fraction,
    )
    p.require(
        math.isfinite(al.epsilon_budget) and al.epsilon_budget >= 0,
        "alerts.epsilon_budget",
        "a number >= 0",
        al.epsilon_budget,
    )
    for i, url in enumerate(al.webhooks):
        p.require(
            _webhook_url_ok(url),
            f"alerts.webhooks[{i}]",
            "an https:// URL (http:// only to localhost or a loopback address: each "
            "delivery carries the capability that acknowledges its alert)",
            url,
        )
    p.positive("alerts.webhook_timeout_s", al.webhook_timeout_s)
    p.int_range("alerts.webhook_attempts", al.webhook_attempts, 1, 100)
    p.positive("alerts.webhook_backoff_s", al.webhook_backoff_s)
    p.positive("dashboard.token_ttl_s", cfg.dashboard.token_ttl_s)
    p.positive("dashboard.push_interval_s", cfg.dashboard.push_interval_s)
    p.require(
        cfg.storage.url == "" or cfg.storage.url.startswith(("postgresql://", "postgres://")),
        "storage.url",
        'empty (SQLite) or a "postgresql://" URL',
        cfg.storage.url,
    )
    _validate_aggregation(p, cfg)
    return p.items


def _features(cfg: FederationConfig) -> compat.Features:
    """The features of ``cfg``'s rounds that constrain one another."""
    d, ag = cfg.dp, cfg.aggregation
    return compat.Features(
        secure_sum=cfg.round.secure_sum,
        round_mode=cfg.round.mode,
        distributed_dp=d.enabled and d.mode == "distributed",
        compressed=cfg.codec.spec().compresses,
        error_feedback=cfg.codec.error_feedback,
        robust=compat.robust_key(ag.rule) if ag != AggregationSection() else "",
    )


def _webhook_url_ok(url: str) -> bool:
    """An https URL with a host, or an http one whose host is this machine."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - a malformed port raises here
    except ValueError:
        return False
    if not host or parts.scheme not in ("http", "https"):
        return False
    if parts.scheme == "https":
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _validate_aggregation(p: _Problems, cfg: FederationConfig) -> None:
    """``[aggregation]``: each parameter the rule reads within its range, none it ignores
    set, and a robust rule only where the aggregator sees individual updates."""
    ag, r, default = cfg.aggregation, cfg.round, AggregationSection()
    read = {*robust.RULE_PARAMETERS[ag.rule], *robust.EVERY_RULE}
    for name, bounds in robust.PARAMETERS.items():
        value, path = getattr(ag, name), f"aggregation.{name}"
        if name in read:
            p.require(bounds.admits(value), path, f"{bounds.describe()} ({bounds.why})", value)
        elif value != getattr(default, name):
            readers = [rule for rule, names in robust.RULE_PARAMETERS.items() if name in names]
            p.fail(path, f"only rule {' and '.join(readers)} reads it, not {ag.rule}: remove it")
    if ag.rule in robust.LEAST_UPDATES:
        extra, why = robust.LEAST_UPDATES[ag.rule]
        least = 2 * ag.byzantine + extra
        p.require(
            r.min_agents >= least,
            "round.min_agents",
            f"at least 2 * aggregation.byzantine + {extra} = {least} for {ag.rule} ({why})",
            r.min_agents,
        )
    if ag.rule == "multi_krum":
        most = r.min_agents - ag.byzantine
        p.require(
            ag.krum_selected <= max(most, 0),
            "aggregation.krum_selected",
            f"at most round.min_agents - aggregation.byzantine = {most} (m <= n - f in every "
            "round)",
            ag.krum_selected,
        )
    if ag.rule == "fltrust":
        p.require(
            cfg.federation.task not in ("csv", "table"),
            "aggregation.rule",
            "a bundled task for fltrust (the aggregator draws its root dataset from the task's "
            "data; the csv and table tasks have none)",
            ag.rule,
        )


def _is_http_url(url: str) -> bool:
    """True for an ``http://`` or ``https://`` URL naming a host."""
    return url.startswith(("http://", "https://")) and len(url) > 8


def _validate_agent(cfg: AgentConfig) -> list[str]:
    p = _Problems()
    a = cfg.agent
    p.identifier("agent.id", a.id)
    urls = [a.aggregator_url] if isinstance(a.aggregator_url, str) else a.aggregator_url
    p.require(
        bool(urls) and all(_is_http_url(url) for url in urls),
        "agent.aggregator_url",
        "an http:// or https:// URL, or a non-empty list of them",
        a.aggregator_url,
    )
    p.require(
        bool(_HEX_KEY.fullmatch(a.aggregator_public_key)),
        "agent.aggregator_public_key",
        "64 hex digits (an Ed25519 public key)",
        a.aggregator_public_key,
    )
    p.require(bool(a.state_dir), "agent.state_dir", "a directory path", a.state_dir)
    devices = "auto, cpu, cuda, cuda:N or mps"
    p.require(bool(_DEVICE.fullmatch(a.device)), "agent.device", devices, a.device)
    d = cfg.data
    p.require(bool(d.task), "data.task", "a task name", d.task)
    match = _PARTITION.fullmatch(d.partition)
    alpha_ok = True
    if match and match.group("alpha") is not None:
        try:
            alpha = float(match.group("alpha"))
            alpha_ok = math.isfinite(alpha) and alpha > 0
        except ValueError:
            alpha_ok = False
    p.require(
        bool(match) and alpha_ok,
        "data.partition",
        "iid or dirichlet:ALPHA with ALPHA > 0",
        d.partition,
    )
    p.int_range("data.parts", d.parts, 1, 100_000)
    p.int_range("data.part_index", d.part_index, 0, max(d.parts - 1, 0))
    p.int_range("data.seed", d.seed, 0)
    p.positive("privacy.epsilon", cfg.privacy.epsilon)
    p.open_unit("privacy.delta", cfg.privacy.delta)
    p.int_range("privacy.min_survivors", cfg.privacy.min_survivors, 1, 100_000)
    w = cfg.training
    p.int_range("training.workers", w.workers, 0, worker_settings.MAX_WORKERS)
    p.int_range("training.max_restarts", w.max_restarts, 0, worker_settings.MAX_RESTARTS)
    p.int_range("training.checkpoint_steps", w.checkpoint_steps, 0)
    p.require(
        math.isfinite(w.checkpoint_interval_s) and w.checkpoint_interval_s >= 0,
        "training.checkpoint_interval_s",
        "a number >= 0",
        w.checkpoint_interval_s,
    )
    p.positive("training.straggler_timeout_s", w.straggler_timeout_s)
    p.int_range("training.nodes", w.nodes, 1, worker_settings.MAX_NODES)
    p.int_range("training.node_rank", w.node_rank, 0, max(w.nodes - 1, 0))
    p.require(
        w.nodes == 1 or worker_settings.endpoint_parts(w.rendezvous_endpoint) is not None,
        "training.rendezvous_endpoint",
        "host:port (port 1..65535) when training.nodes > 1",
        w.rendezvous_endpoint,
    )
    p.int_range(
        "privacy.tolerated_corrupt_neighbours", cfg.privacy.tolerated_corrupt_neighbours, 0, 1000
    )
    n = cfg.network
    p.int_range("network.retry_max", n.retry_max, 0, 1000)
    p.positive("network.backoff_initial_s", n.backoff_initial_s)
    p.positive("network.backoff_max_s", n.backoff_max_s)
    p.require(
        n.backoff_max_s >= n.backoff_initial_s,
        "network.backoff_max_s",
        f"a number >= backoff_initial_s ({n.backoff_initial_s})",
        n.backoff_max_s,
    )
    p.positive("network.timeout_s", n.timeout_s)
    p.items.extend(_table_problems("data", d.task, d.schema))
    if d.task == "table":
        p.require(bool(d.sources), "data.sources", "at least one [[data.sources]]", [])
    p.require(
        0.0 <= d.summary_epsilon <= 1.0 and math.isfinite(d.summary_epsilon),
        "data.summary_epsilon",
        "a number in [0, 1] (0 = exact counts)",
        d.summary_epsilon,
    )
    for problem in d.rules.check_problems() if d.rules is not None else []:
        p.items.append(f"data.rules.{problem}")
    return p.items


def _table_problems(section: str, task: str, schema: DataSchema | None) -> list[str]:
    """Task "table" needs a schema, and a schema that can be encoded."""
    if task != "table":
        return [f'{section}.schema: only task "table" takes a schema'] if schema else []
    if schema is None:
        key = "schema" if section == "federation" else f"{section}.schema"
        return [f'{key}: task "table" needs the federation\'s [{key}] section']
    try:
        schema.check()
    except ConfigError as exc:
        return [exc.detail]
    return []


def table_task_options(schema: DataSchema) -> dict[str, Any]:
    """The options of task "table" that a schema implies: its features and classes."""
    return {"features": schema.feature_names(), "classes": list(schema.classes)}


# -- loading ---------------------------------------------------------------------------------

_C = typing.TypeVar("_C", FederationConfig, AgentConfig)

_MSGSPEC_ERROR = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _parse(
    text: str,
    source: str,
    kind: type[_C],
    validate: Callable[[_C], list[str]],
    prepare: Callable[[dict[str, Any]], None] | None = None,
) -> _C:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    if prepare is not None:
        prepare(doc)
    try:
        cfg = msgspec.convert(doc, type=kind, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc), doc, kind)}") from None
    problems = validate(cfg)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return cfg


def _explain(message: str, doc: Mapping[str, Any], kind: type) -> str:
    """Turn a msgspec error into ``key.path: reason, got value``."""
    match = _MSGSPEC_ERROR.match(message)
    assert match is not None
    msg, raw_path = match.group("msg"), (match.group("path") or "")
    segments = [s for s in re.split(r"\.|\[(\d+)\]", raw_path) if s]
    path = ".".join(segments)
    unknown = re.match(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        return f"{_join(path, unknown.group(1))}: unknown key"
    missing = re.match(r"Object missing required field `(.+)`", msg)
    if missing:
        return f"{_join(path, missing.group(1))}: required key is missing"
    got = _lookup(doc, segments)
    literal = _literal_choices(kind, segments)
    if literal is not None:
        choices = ", ".join(repr(c) for c in literal)
        return f"{path}: expected one of {choices}, got {_show(got)}"
    expected = re.match(r"Expected `([^`]+)`", msg)
    if expected:
        return f"{path}: expected {_type_words(expected.group(1))}, got {_show(got)}"
    return f"{path}: {msg}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_words(name: str) -> str:
    return {
        "int": "an integer",
        "float": "a number",
        "str": "a string",
        "bool": "true or false",
        "object": "a table",
    }.get(name, name)


def _lookup(doc: Any, segments: list[str]) -> object:
    for seg in segments:
        if isinstance(doc, Mapping) and seg in doc:
            doc = doc[seg]
        elif isinstance(doc, list) and seg.isdigit() and int(seg) < len(doc):
            doc = doc[int(seg)]
        else:
            return "?"
    return doc


def _literal_choices(kind: type, segments: list[str]) -> tuple[object, ...] | None:
    current: Any = kind
    for seg in segments:
        if not (isinstance(current, type) and issubclass(current, msgspec.Struct)):
            return None
        hints = typing.get_type_hints(current)
        if seg not in hints:
            return None
        current = hints[seg]
    if typing.get_origin(current) is Literal:
        return typing.get_args(current)
    return None


def _resolve(base: Path, value: str) -> str:
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read configuration file: {exc}") from None


#: FedAdam's server learning rate where ``server.server_lr`` is unset: with record-level
#: distributed DP, and otherwise (see the field's docstring and docs/privacy.md).
DDP_FEDADAM_LR = 0.03
FEDADAM_LR = 0.01


def server_defaults(dp_enabled: bool, dp_mode: str, dp_unit: str) -> tuple[str, float]:
    """The server optimiser and its learning rate a federation gets where it names neither:
    FedAdam at :data:`DDP_FEDADAM_LR` with record-level distributed DP, else FedAvg at 1.0."""
    if dp_enabled and dp_mode == "distributed" and dp_unit == "record":
        return "fedadam", DDP_FEDADAM_LR
    return "fedavg", 1.0


def fill_server_defaults(doc: dict[str, Any]) -> None:
    """Write the derived ``server.optimizer`` / ``server.server_lr`` into a parsed document
    where it leaves them unset (malformed tables are left to the type check)."""
    server, dp = doc.get("server", {}), doc.get("dp", {})
    if not isinstance(server, dict) or not isinstance(dp, dict):
        return
    defaults = DPSection()
    optimizer, lr = server_defaults(
        bool(dp.get("enabled", defaults.enabled)),
        str(dp.get("mode", defaults.mode)),
        str(dp.get("unit", defaults.unit)),
    )
    chosen = server.setdefault("optimizer", optimizer)
    if "server_lr" not in server and chosen == "fedadam":
        server["server_lr"] = lr if chosen == optimizer else FEDADAM_LR
    doc["server"] = server


def parse_federation_config(text: str, source: str = "federation.toml") -> FederationConfig:
    """Validate TOML text as a federation config (paths are left as written).

    Raises:
        ConfigError: naming ``source``, the key path and the reason.
    """
    cfg = _parse(text, source, FederationConfig, _validate_federation, fill_server_defaults)
    if cfg.schema is not None:
        fed = msgspec.structs.replace(cfg.federation, task_options=table_task_options(cfg.schema))
        cfg = msgspec.structs.replace(cfg, federation=fed)
    return cfg


def parse_agent_config(text: str, source: str = "agent.toml") -> AgentConfig:
    """Validate TOML text as an agent config (paths are left as written).

    Raises:
        ConfigError: naming ``source``, the key path and the reason.
    """
    cfg = _parse(text, source, AgentConfig, _validate_agent)
    if cfg.data.schema is not None:
        data = msgspec.structs.replace(cfg.data, task_options=table_task_options(cfg.data.schema))
        cfg = msgspec.structs.replace(cfg, data=data)
    return cfg


def load_federation_config(path: Path) -> FederationConfig:
    """Read and validate ``federation.toml``; TLS paths resolved against its directory.

    Raises:
        ConfigError: missing/unreadable file, bad TOML, unknown key, bad value.
    """
    path = Path(path)
    cfg = parse_federation_config(_read(path), str(path))
    base = path.parent.resolve()
    server = msgspec.structs.replace(
        cfg.server,
        tls_cert=_resolve(base, cfg.server.tls_cert),
        tls_key=_resolve(base, cfg.server.tls_key),
    )
    return msgspec.structs.replace(cfg, server=server)


def load_agent_config(path: Path) -> AgentConfig:
    """Read and validate ``agent.toml``; state_dir and csv resolved against its directory.

    Raises:
        ConfigError: missing/unreadable file, bad TOML, unknown key, bad value.
    """
    path = Path(path)
    cfg = parse_agent_config(_read(path), str(path))
    base = path.parent.resolve()
    agent = msgspec.structs.replace(cfg.agent, state_dir=_resolve(base, cfg.agent.state_dir))
    data = _resolve_data(cfg.data, base, path)
    return msgspec.structs.replace(cfg, agent=agent, data=data)


def _resolve_data(data: DataSection, base: Path, path: Path) -> DataSection:
    """Source and key paths against the file's directory; a file holding a database
    password must be readable by its owner only."""
    sources = [
        msgspec.structs.replace(
            s,
            path=_resolve(base, s.path),
            password_file=_resolve(base, s.password_file),
        )
        for s in data.sources
    ]
    if any(s.kind == "sql" for s in sources):
        from fedsec.data.sources import check_private_file, url_has_password

        if any(url_has_password(s.url) for s in sources):
            check_private_file(path, "agent configuration")
    rules = data.rules
    if rules is not None and rules.hash_key_file:
        rules = msgspec.structs.replace(rules, hash_key_file=_resolve(base, rules.hash_key_file))
    return msgspec.structs.replace(data, csv=_resolve(base, data.csv), sources=sources, rules=rules)


# -- writing -------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(value: str) -> str:
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_value(value: object) -> str:
    """One TOML value: strings, bools, ints, floats, lists and (inline) tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        inner = ", ".join(f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }"
    raise ConfigError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def _wrap_comment(text: str, width: int = 88) -> Iterator[str]:
    line = "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width and line != "#":
            yield line
            line = "#"
        line += " " + word
    yield line


def render_toml(cfg: FederationConfig | AgentConfig, title: str) -> str:
    """A config as TOML text with every key documented by a comment."""
    doc = msgspec.to_builtins(cfg)
    derived = _derived(doc) if isinstance(cfg, FederationConfig) else {}
    lines = [f"# {title}", "# Reference: docs/config.md. Unknown keys are refused.", ""]
    for section, table in doc.items():
        if table is None:  # an optional section left out
            continue
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is None:
                continue
            why = key_docs().get(f"{section}.{key}")
            if why:
                lines.extend(_wrap_comment(why))
            # a value the other sections derive stays unset, so it follows them when edited
            unset = derived.get(f"{section}.{key}", _NOT_DERIVED) == value
            lines.append(f"{'# ' if unset else ''}{_toml_key(key)} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


_NOT_DERIVED = object()


def _derived(doc: dict[str, Any]) -> dict[str, Any]:
    """Key path -> the value :func:`fill_server_defaults` gives a document that leaves
    the key unset, with the rest of ``doc`` as it is."""
    server = {k: v for k, v in doc["server"].items() if k not in ("optimizer", "server_lr")}
    bare: dict[str, Any] = {"server": server, "dp": doc["dp"]}
    fill_server_defaults(bare)
    with_optimizer: dict[str, Any] = {
        "server": {**server, "optimizer": doc["server"]["optimizer"]},
        "dp": doc["dp"],
    }
    fill_server_defaults(with_optimizer)
    return {
        "server.optimizer": bare["server"]["optimizer"],
        "server.server_lr": with_optimizer["server"].get("server_lr", 1.0),
    }


def _write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), text.encode("utf-8"), parents_mode=0o755)


def dump_federation_config(cfg: FederationConfig, path: Path) -> None:
    """Write ``cfg`` as documented TOML to ``path`` (atomically)."""
    _write_text(path, render_toml(cfg, f"fedsec federation {cfg.federation.id}"))


def dump_agent_config(cfg: AgentConfig, path: Path) -> None:
    """Write ``cfg`` as documented TOML to ``path`` (atomically)."""
    _write_text(path, render_toml(cfg, f"fedsec agent {cfg.agent.id}"))


def default_federation_toml(federation_id: str, task: str = "breast_cancer") -> str:
    """A documented ``federation.toml`` with every default spelled out.

    Raises:
        ConfigError: ``federation_id`` or ``task`` is invalid.
    """
    cfg = FederationConfig(federation=FederationSection(id=federation_id, task=task))
    problems = _validate_federation(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    return render_toml(cfg, f"fedsec federation {federation_id}")
