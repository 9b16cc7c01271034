"""Limits and defaults every layer agrees on, each declared once with the reason for its
value."""

from __future__ import annotations

from typing import Final

from fedsec.crypto.secagg.messages import MAX_COHORT as _SECAGG_MAX_COHORT

#: Largest round, attempt or model version on the wire: SQLite stores 64-bit integers
#: and a path value becomes a file name, so every number from the network is bounded
#: where it is decoded.  2^31 - 1 rounds is centuries of one-second rounds.
MAX_ID: Final = 2**31 - 1
#: Largest count or token (samples, steps, log indices, the long-poll token): 2^53 - 1
#: is exact in a JSON double and in SQLite's 64-bit integers.
MAX_COUNT: Final = 2**53 - 1
#: Largest model file anyone reads (agent download, aggregator store, auditor):
#: 1 GiB is a float32 model of 268M parameters, far above any bundled task, and
#: bounds what a hostile or broken peer can make a reader allocate.
MAX_MODEL_BYTES: Final = 1 << 30
#: Longest the aggregator holds a long-poll or a held stage answer.  25 s stays under
#: common proxy idle timeouts (nginx's proxy_read_timeout defaults to 60 s, many load
#: balancers 30 s) and keeps an idle agent at about two requests a minute.
LONG_POLL_S: Final = 25.0
#: Largest cohort (round.max_agents, checked by fedsec.config): bounds every list of
#: members on the wire.  The SecAgg+ crypto's bound (share x-coordinates are 16-bit, so
#: 65,535 members), declared there because crypto imports nothing of fedsec; one bound
#: for every mode, so a federation valid in one mode stays valid when it switches, and
#: none passes its config only to fail when the spec is built.  65,535 members is still
#: past any consortium of organisations.
MAX_COHORT: Final = _SECAGG_MAX_COHORT
#: Fewest contributions a secure sum (SecAgg+ or HE) may reveal: with two, each member
#: subtracts its own update from the sum and reads the other's.  round.min_agents must
#: reach it (fedsec.config), and the HE custodian decrypts no smaller sum, whatever the
#: federation says.
MIN_SECURE_SUM: Final = 3
#: DP δ when a federation or an owner sets none (dp.delta, privacy.delta, tools): it must
#: be well below 1/records; 10^-5 suits datasets of up to ~10^4 records.
DEFAULT_DELTA: Final = 1e-5
#: Most earlier charges one privacy report declares as never reported (a member charged
#: for trainings whose reports the aggregator never took: dropped before its shares
#: landed, or restarted mid-round).  Each report taken clears them, so only a member
#: that missed this many rounds in a row reaches it; 256 entries are ~30 KB of JSON,
#: well inside server.max_json_bytes.
MAX_UNREPORTED_CHARGES: Final = 256
