#!/usr/bin/env bash
# `make bench`: the standard benchmark set; results in bench/results/*.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
FEDSEC=.venv/bin/fedsec
PY=.venv/bin/python
out=bench/results
mkdir -p "$out"
echo "== secagg (SecAgg+ n=100 d=1e6, default k and t, b=8, 10% lost after share keys)"
$FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage masked \
  --bits 8 --repeat 3 --json | tee "$out/secagg.jsonl"
echo "== secagg ring widths (bit packing): b = 2, 4, 6 (9-13-bit rings), then --ring-bits 16-32"
for args in "--bits 2" "--bits 4" "--bits 6" "--bits 8 --ring-bits 16" "--bits 8 --ring-bits 20" \
    "--bits 8 --ring-bits 23" "--bits 8 --ring-bits 24" "--bits 8 --ring-bits 27" \
    "--bits 8 --ring-bits 32"; do
  # shellcheck disable=SC2086  # $args is several options
  $FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage masked \
    $args --repeat 3 --json | tee -a "$out/secagg.jsonl"
done
echo "== secagg classic (k = n-1, t = 51 as the consistency stage needs, n=100 d=1e5)"
$FEDSEC bench secagg --clients 100 --dim 100000 --dropout 0.1 --dropout-stage masked \
  --neighbors 99 --threshold 51 --bits 8 --repeat 3 --json | tee "$out/secagg-classic.jsonl"
for stage in advertise share unmask; do
  echo "== secagg, 10% lost at $stage"
  $FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage $stage \
    --bits 8 --json | tee "$out/secagg-drop-$stage.jsonl"
done
# fedsec simulate: 50 MNIST-1D agents over loopback HTTP vs the same model trained centrally
# for rounds x local_epochs epochs (SIM_DEFAULTS in fedsec/simulation.py).  The IID runs
# with and without SecAgg+ give the secure-summation wall-time overhead.
SIM="$FEDSEC simulate --task mnist1d --agents 50 --quant-bits 8 --seed 0 --json"
echo "== simulate mnist1d, 10 agents, 15 rounds, seeds 0-2: make bench-check's accuracy baseline"
for seed in 0 1 2; do
  $FEDSEC simulate --task mnist1d --agents 10 --rounds 15 --secure-sum secagg --dp-epsilon none \
    --seed $seed --json | tee -a "$out/simulate.jsonl"
done
echo "== simulate mnist1d, 50 agents, IID, SecAgg+"
$SIM --rounds 150 --partition iid --secure-sum secagg --dp-epsilon none | tee -a "$out/simulate.jsonl"
echo "== simulate mnist1d, 50 agents, IID, no secure summation"
$SIM --rounds 150 --partition iid --secure-sum none --dp-epsilon none | tee -a "$out/simulate.jsonl"
echo "== simulate mnist1d, 50 agents, Dirichlet 0.5, SecAgg+"
$SIM --rounds 150 --partition dirichlet:0.5 --secure-sum secagg --dp-epsilon none | tee -a "$out/simulate.jsonl"
echo "== simulate mnist1d, 50 agents, IID, SecAgg+, DP epsilon 8"
$SIM --rounds 40 --partition iid --secure-sum secagg --dp-epsilon 8 | tee -a "$out/simulate.jsonl"
echo "== distributed DP over SecAgg+ (record level), epsilon 8, two seeds"
for seed in 0 1; do
  $FEDSEC simulate --task mnist1d --agents 50 --rounds 200 --dp-epsilon 8 --dp-mode distributed \
    --dp-min-survivors 0.96 --server-lr 0.03 --secure-sum secagg --seed $seed --json | tee -a "$out/ddp.jsonl"
done
echo "== distributed DP over SecAgg+ (record level): epsilon 3 and 1 through the real round"
for eps in 3 1; do
  $FEDSEC simulate --task mnist1d --agents 50 --rounds 200 --dp-epsilon $eps --dp-mode distributed \
    --dp-min-survivors 0.96 --server-lr 0.03 --secure-sum secagg --seed 0 --json | tee -a "$out/ddp.jsonl"
done
echo "== distributed DP over SecAgg+ (record level): digits, epsilon 8, 3 and 1 through the real round"
for eps in 8 3 1; do
  $FEDSEC simulate --task digits --agents 50 --rounds 200 --dp-epsilon $eps --dp-mode distributed \
    --dp-min-survivors 0.96 --server-lr 0.03 --secure-sum secagg --seed 0 --json | tee -a "$out/ddp.jsonl"
done
echo "== ddp: member level through the real round (50 members: the noise drowns the mean)"
$FEDSEC simulate --task mnist1d --agents 50 --rounds 40 --dp-epsilon 8 --dp-mode distributed \
  --dp-unit member --secure-sum secagg --seed 0 --json | tee -a "$out/ddp.jsonl"
echo "== compression: 8-bit plain vs rotated 2- and 4-bit with a shared subset (8x and 16x payload)"
for seed in 0 1 2; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  $C --quant-bits 8 | tee -a "$out/compression.jsonl"
  for args in "2 --sparsity 0.4" "2 --sparsity 0.24" "4 --sparsity 0.38" "4 --sparsity 0.19" \
      "4 --sparsity 0.38 --error-feedback" "4 --sparsity 0.19 --error-feedback"; do
    $C --rotation hadamard --quant-bits $args | tee -a "$out/compression.jsonl"
  done
done
echo "== compression: more seeds for the 8x codec against the 8-bit run"
for seed in 3 4 5; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  $C --quant-bits 8 | tee -a "$out/compression.jsonl"
  $C --rotation hadamard --quant-bits 4 --sparsity 0.38 | tee -a "$out/compression.jsonl"
done
echo "== compression: 2 bits over a range sized for typical updates (8x and 16x payload)"
for seed in 0 1 2 3 4 5; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  $C --rotation hadamard --quant-bits 2 --sparsity 0.49 --range-stddevs 1 | tee -a "$out/compression.jsonl"
done
for seed in 0 1 2 3 4 5; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  C="$C --rotation hadamard --quant-bits 2 --sparsity 0.24 --range-stddevs 1"
  $C | tee -a "$out/compression.jsonl"
  [ "$seed" -ge 2 ] || $C --server-lr 0.7 | tee -a "$out/compression.jsonl"
done
echo "== audit detection (control-sample checks), epsilon 8 and 3"
for eps in 8 3; do
  $FEDSEC bench audit --task mnist1d --agents 20 --rounds 5 --bad 0.2 \
    --attacks zero,noise,replay,signflip,scale --dp-epsilon $eps --trials 6 --json | tee -a "$out/audit.jsonl"
done
echo "== chaos: aggregator killed at every stage, compared with an uninterrupted run"
$FEDSEC bench chaos --agents 6 --rounds 5 --json | tee -a "$out/chaos.jsonl"
# Replicated aggregator (docs/deployment.md): a temporary PostgreSQL cluster of this
# machine's server, so these need Debian's postgresql (make system-deps installs it).
echo "== failover: leader SIGKILLed once per round at every stage, standby takes over;"
echo "   then the leader paused past its lease (the fence); both against an uninterrupted run"
$FEDSEC bench failover --agents 6 --rounds 5 --json | tee -a "$out/failover.jsonl"
echo "== failover: HE (key custodian) and buffered rounds, the leader killed once mid-round"
for mode in he buffered; do
  $FEDSEC bench failover --mode $mode --agents 6 --rounds 5 --json | tee -a "$out/failover.jsonl"
done
echo "== store: simulate round time on PostgreSQL against SQLite (50 members, 3 interleaved pairs)"
$FEDSEC bench store --agents 50 --rounds 5 --pairs 3 --json | tee -a "$out/store.jsonl"
echo "== async: buffered vs synchronous rounds, 20% of members 10x slower"
$FEDSEC bench async --json | tee -a "$out/async.jsonl"
echo "== ops: /metrics latency (100 members, 1,000 closed rounds) and the dashboard's cost"
$FEDSEC bench ops --part metrics --members 100 --closed-rounds 1000 --repeat 1000 --json | tee "$out/ops.jsonl"
$FEDSEC bench ops --part dashboard --agents 50 --rounds 30 --pairs 3 --viewers 2 --json | tee -a "$out/ops.jsonl"
echo "== he: CKKS sum-only primitives (TenSEAL), 10 members, d = 1M"
$FEDSEC bench he --clients 10 --dim 1000000 --json | tee "$out/he.jsonl"
echo "== simulate: homomorphic summation against SecAgg+, interleaved (mnist1d, 50 agents)"
for seed in 0 1; do
  $SIM --rounds 30 --partition iid --secure-sum secagg --dp-epsilon none --seed $seed | tee -a "$out/he-simulate.jsonl"
  $SIM --rounds 30 --partition iid --secure-sum he --dp-epsilon none --seed $seed | tee -a "$out/he-simulate.jsonl"
done
echo "== simulate: homomorphic summation with 30 % of the members lost in round 3"
$FEDSEC simulate --task mnist1d --agents 50 --rounds 4 --secure-sum he --kill 0.3 --kill-round 3 \
  --json | tee -a "$out/he-simulate.jsonl"
echo "== inventory: data map of a 1,000,000-row, 50-column CSV (floor: the bare CSV read);"
echo "   sensitive-field detection on the labelled 44-column table"
$FEDSEC bench inventory --rows 1000000 --columns 50 --repeat 3 --json | tee "$out/inventory.jsonl"
echo "== ddp: record-level distributed DP vs central DP at the same epsilon (docs/privacy.md)"
for eps in 8 3 1; do
  $FEDSEC bench ddp --task mnist1d --lr 0.03 --min-survivors 0.96 --dp-epsilon $eps --json | tee -a "$out/ddp.jsonl"
  $FEDSEC bench ddp --task digits --batch 360 --lr 0.03 --min-survivors 0.96 --dp-epsilon $eps --json | tee -a "$out/ddp.jsonl"
done
echo "== ddp: local DP for the comparison (fedsec simulate, 50 agents, 40 rounds)"
for task in mnist1d digits; do for eps in 8 3 1; do
  $FEDSEC simulate --task $task --agents 50 --rounds 40 --quant-bits 8 --seed 0 --secure-sum secagg \
    --dp-epsilon $eps --json | tee -a "$out/ddp.jsonl"
done; done
echo "== ddp: SecAgg+ member time with and without distributed noise (n=100, d=1e6, 16-bit ring)"
for k in 0; do for noise in 0 1; do  # k = 7 needs t = 5 since the consistency stage
  $FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage masked \
    --neighbors $k --bits 9 --repeat 2 --ddp-noise $noise --json | tee -a "$out/ddp.jsonl"
done; done
echo "== compression: SecAgg+ with the codec at d=1e6, n=100 (docs/compression.md)"
for args in "--bits 8" "--bits 2 --rotation hadamard --sparsity 0.4" \
  "--bits 4 --rotation hadamard --sparsity 0.36" "--bits 4 --rotation hadamard --sparsity 0.18"; do
  $FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage masked \
    $args --repeat 2 --json | tee -a "$out/compression.jsonl"
done
echo "== compression: at d=1e6 with fewer ring headroom bits, beside its no-wrap baseline"
for args in "--bits 2 --rotation hadamard --sparsity 0.4" \
  "--bits 2 --rotation hadamard --sparsity 0.57 --range-stddevs 1 --headroom-bits 5"; do
  $FEDSEC bench secagg --clients 100 --dim 1000000 --dropout 0.1 --dropout-stage masked \
    $args --repeat 2 --json | tee -a "$out/compression.jsonl"
done
echo "== compression: fewer ring headroom bits at the same 8.4x payload, in-process (docs/compression.md)"
for seed in 0 1; do
  $PY bench/headroom_check.py --seed $seed --headroom 6 5 4 3 --keep 0.38 0.42 0.475 0.543 \
    | tee -a "$out/compression.jsonl"
  $PY bench/headroom_check.py --seed $seed --bits 8 --headroom 6 --keep 1 | tee -a "$out/compression.jsonl"
done
echo "== compression: 2 bits at range 1 with 4 headroom bits (a ring that may wrap), in-process"
for seed in 0 1; do
  $PY bench/headroom_check.py --seed $seed --bits 2 --range-stddevs 1 --headroom 6 4 6 4 \
    --keep 0.24 0.332 0.49 0.666 | tee -a "$out/compression.jsonl"
  $PY bench/headroom_check.py --seed $seed --bits 8 --headroom 6 --keep 1 | tee -a "$out/compression.jsonl"
done
echo "== compression: codec.headroom_bits = 4 through the real round (8x and 16x payload)"
for seed in 0 1 2 3 4 5; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  C="$C --rotation hadamard --quant-bits 2 --range-stddevs 1 --headroom-bits 4"
  $C --sparsity 0.332 | tee -a "$out/compression.jsonl"
  $C --sparsity 0.666 | tee -a "$out/compression.jsonl"
done
echo "== compression: four more seeds for the 8x codec with 4 headroom bits, each beside its 8-bit run"
for seed in 6 7 8 9; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 150 --secure-sum secagg --seed $seed --json"
  $C --quant-bits 8 | tee -a "$out/compression.jsonl"
  $C --rotation hadamard --quant-bits 2 --range-stddevs 1 --headroom-bits 4 --sparsity 0.666 \
    | tee -a "$out/compression.jsonl"
done
echo "== compression: other ways to 16x, screened in-process beside the 4-headroom-bit run above"
for seed in 0 1; do
  H="$PY bench/headroom_check.py --seed $seed --bits 2 --range-stddevs 1 --headroom 4 --keep 0.332"
  for extra in "--server-momentum 0.5" "--server-momentum 0.7" "--server-momentum 0.9" \
    "--server-momentum 0.8 --server-lr 2" "--drop-edges"; do
    $H $extra | tee -a "$out/compression.jsonl"
  done
  $PY bench/headroom_check.py --seed $seed --bits 2 --range-stddevs 1 --headroom 5 --keep 0.284 \
    | tee -a "$out/compression.jsonl"
  $H --local-epochs 4 | tee -a "$out/compression.jsonl"
  if [ "$seed" = 0 ]; then $H --server-optimizer fedadam | tee -a "$out/compression.jsonl"; fi
  for range in 1.25 1.5; do
    $PY bench/headroom_check.py --seed $seed --bits 2 --range-stddevs $range --headroom 4 \
      --keep 0.332 | tee -a "$out/compression.jsonl"
  done
done
echo "== compression: the 16x codec with 4 headroom bits over 200 rounds, and 8-bit over 200"
for seed in 0 1 2 3 4 5; do
  C="$FEDSEC simulate --task mnist1d --agents 50 --rounds 200 --secure-sum secagg --seed $seed --json"
  $C --rotation hadamard --quant-bits 2 --range-stddevs 1 --headroom-bits 4 --sparsity 0.332 \
    | tee -a "$out/compression.jsonl"
  $C --quant-bits 8 | tee -a "$out/compression.jsonl"
done
echo "== robust: 7 aggregation rules x 6 attacks (+ none), 50 MNIST-1D members, 20 % attackers;"
echo "   in-process with the real training, rule and control-check code (docs/robustness.md)"
ROBUST="$FEDSEC bench robust --task mnist1d --agents 50 --bad 0.2 --rounds 20 --json"
$ROBUST | tee "$out/robust.jsonl"
echo "== robust: every rule's no-attack cost with Dirichlet(0.5) members"
$ROBUST --partition dirichlet:0.5 --attacks none | tee -a "$out/robust.jsonl"
echo "== robust: SecAgg+ (sum only) with audit quarantine and rollback"
$ROBUST --secure-sum secagg --defence audit-quarantine --attacks signflip,scale,zero \
  --challenge-rate 0.5 | tee -a "$out/robust.jsonl"
