#!/usr/bin/env bash
# QEvict's decode step before (637407a, staged from _base/) and after HEAD (its ring write as
# one slot-write kernel on GPU, the left ring slots emptied by the routing event, the ranking's
# GPU form, first positions in the event's tables), interleaved; then its policy step traced.
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
S() { local name=$1 dir=$2 rows=$3; (cd $dir && ROWS="$rows" OUT=/tmp/o/$name bash scripts/gpu_bench.sh decode-scan) > $OUT/$name.log 2>&1; date -u; echo "== $name"; grep -v "^$\|^+" $OUT/$name.log | tail -4; for f in /tmp/o/$name/*.json; do cp $f $OUT/${name}_$(basename $f); done; }
S head1 . qevict
S base1 _base qevict
S head2 . qevict
PROBE_STACKED=1 OUT=/tmp/o/tq bash scripts/gpu_bench.sh trace-policy 32 qevict:6554 > $OUT/tq.log 2>&1
date -u; head -42 /tmp/o/tq/trace_policy.txt; cp /tmp/o/tq/trace_policy.txt $OUT/trace_policy_qevict.txt
S base2 _base qevict
