#!/usr/bin/env bash
# Decode benchmarks on a GPU machine whose Python already has jax[cuda], flax, numpy, rich, tqdm
# (the lent H200 image). kvjax is staged on PYTHONPATH rather than pip-installed, so nothing is
# built there. Results: JSON under $OUT (default runs/gpu). Numbers go to docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
if compgen -G ".whl/*.whl" >/dev/null; then  # wheels missing on that image (gguf)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
stage=/tmp/kvjax-stage
rm -rf "$stage" && mkdir -p "$stage"
cp -r kvjax "$stage/kvjax"
cp -r eval "$stage/kvjax/eval"
cp -r train "$stage/kvjax/train"
cp -r pallas_kernels "$stage/kvjax/pallas_kernels"
export PYTHONPATH="$stage:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/gpu.txt"
# Run from /tmp so the repo folder does not shadow the staged package.
run() { echo "+ kvjax $*"; (cd /tmp && python3 -m kvjax "$@"); }
# The embedded GGUF at /tmp/smollm2.gguf from its parts (those stashed by earlier calls in
# /tmp/parts, the last carried now), checked against its SHA-256. A call carries at most 64 MiB
# with the tree, so the file goes in three parts (`split -n 3 -d`): `stash` with part_00, `stash`
# with part_01, then the job with part_02 and sha256.txt.
reassemble_gguf() {
  cp -n .gguf-parts/part_* /tmp/parts/ 2>/dev/null || true
  cat /tmp/parts/part_* > /tmp/smollm2.gguf
  (cd .gguf-parts && echo "$(cut -d' ' -f1 sha256.txt)  /tmp/smollm2.gguf" | sha256sum -c)
}
# par_groups NAME GROUPS ARGS...: `kvjax NAME ARGS --policy GROUP` for each ";"-separated GROUP
# at once, one process each sharing the GPU (no preallocation). A group is policies, then any
# flags of its own, given after the shared ARGS so they override them (argparse keeps the last
# occurrence): "confkv --ratios 0.25 0.5" runs confkv at those ratios only. A call returns only
# a few files, so everything under /tmp/NAME goes into $OUT/NAME.tgz, also when the call is cut
# by its limit.
# XLA_FLAGS default: cuBLAS for every dot and no autotuning. With XLA's Triton GEMMs and their
# autotuning, 16 `kvjax ruler` processes at once spent 500-520 s before their first sample (each
# compiling and autotuning the same dots on the shared GPU); without, each finished 60 samples in
# about 2 minutes, with the same scores (docs/lab/2026-12-03-h200-stream-ruler.md). Set
# XLA_FLAGS (even empty) to override.
par_groups() {
  local name=$1 spec=$2 dir=/tmp/$1 final=$OUT i=0 grp groups
  shift 2
  reassemble_gguf
  export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
  export XLA_FLAGS="${XLA_FLAGS---xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0}"
  rm -rf "$dir" && mkdir -p "$dir"
  IFS=';' read -ra groups <<< "$spec"
  for grp in "${groups[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    run "$name" --model /tmp/smollm2.gguf "$@" --policy $grp --out-dir "$dir/${name}_g$i" --json \
      > "$dir/${name}_g$i.out" 2> "$dir/${name}_g$i.log" &
  done
  # cut by its limit (TERM) or done: stop the groups, then pack what they wrote
  # shellcheck disable=SC2064
  trap "kill \$(jobs -p) 2>/dev/null || true; wait || true; tar czf '$final/$name.tgz' -C /tmp $name" EXIT TERM
  wait
}
# The shipped KVpop scorers fit SmolLM2's shapes: an untrained mLSTM scorer of Llama-3-8B's (the
# same work per step; its scores rank nothing useful), written once; prints its path.
llama3_scorer() {
  local f=/tmp/kvpop_untrained_llama3.msgpack
  [ -f $f ] || (cd /tmp && python3 -c 'import jax; from kvjax.scorers import _io, _modules as m
c = m.ScorerConfig(kind="mlstm", num_layers=32, num_kv_heads=8, head_dim=128)
_io.save_scorer("'$f'", c, m.init_scorer_params(c, jax.random.key(0)), {"trained": False})')
  echo $f
}
# trace-policy / trace-decode of kvpop at Llama-3-8B shapes take that scorer (PROBE_SET: fields
# the probe scripts set on their policy)
kvpop_probe() { if [[ " $* " == *" kvpop:"* ]]; then export PROBE_SET="scorer=$(llama3_scorer)"; fi; }
case "${1:-foundation}" in
  foundation)
    run bench decode --preset Llama-3-8B --dtype bfloat16 --policy full window --budget 4096 \
      --contexts 32768 --batch 8 --steps 32 --copy-mib 4096 --out "$OUT/decode_llama3_8b_b8.json"
    run bench decode --preset Llama-3-8B --dtype bfloat16 --policy full --contexts 32768 \
      --batch 1 --steps 32 --copy-mib 4096 --out "$OUT/decode_llama3_8b_b1.json"
    run bench decode --preset SmolLM2-135M --dtype bfloat16 --policy full window --budget 256 \
      --contexts 1024 4096 --batch 1 --steps 64 --copy-mib 4096 --out "$OUT/decode_smollm2.json"
    ;;
  kernel)  # compiled (not interpreted) kernel tests, then `bench kernel` (+ SWEEP knob grid;
    # KERNEL_ARGS: more `bench kernel` arguments, e.g. "--page 64 --value-group 128")
    if [ -z "${SKIP_TESTS:-}" ]; then
      # cuda first (the default backend), cpu for the TPU-interpreter cases' host callbacks.
      # Compiling is CPU-bound: with pytest-xdist on the image, 8 workers share the GPU
      # (no preallocation, so each takes only what its small cases need).
      # KTESTS: test files of tests/pallas_kernels to run (default: every kernel file);
      # KSELECT: their pytest -k expression (default: every compiled case, "not Interpret").
      tests=()
      for f in ${KTESTS:-test_decode_attention.py test_slot_write.py test_lowbit_unpack.py \
        test_mgpu.py}; do tests+=("$OLDPWD/tests/pallas_kernels/$f"); done
      par=()
      if python3 -c "import xdist" 2>/dev/null; then par=(-n 8); fi
      (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu \
        timeout "${TEST_TIMEOUT:-300}" python3 -P -m pytest -q "${par[@]}" \
        --maxfail=5 -p no:cacheprovider -p no:benchmark -c "$OLDPWD/pyproject.toml" --rootdir "$OLDPWD" \
        --continue-on-collection-errors -W ignore::pytest.PytestConfigWarning \
        "${tests[@]}" -k "${KSELECT:-not Interpret}" \
        >"$OUT/kernel_tests.txt" 2>&1) || true
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/kernel_tests.txt" | tail -20 || true
    fi
    # Ours first: a slow baseline at the end cannot hide our rows. One line per row as it ends.
    # shellcheck disable=SC2086
    run bench kernel --batch ${BATCHES:-8 1} --contexts ${CONTEXTS:-16384 32768 65536} \
      --rows ${ROWS:-copy pallas-bf16 pallas-int8 pallas-int4 pallas-int2 pallas-int4-f32stats \
      pallas-int2-f32stats pallas-bf16+logits mgpu-bf16 mgpu-int8 mgpu-bf16+logits cudnn-bf16 \
      xla-bf16 xla-dequant-int8} \
      ${SWEEP:+--sweep $SWEEP --sweep-rows ${SWEEP_ROWS:-pallas-bf16}} ${KERNEL_ARGS:-} \
      --out "$OUT/kernel.json" \
      | tee "$OUT/kernel.txt"
    ;;
  tests)  # test files of this checkout run on the GPU (compiled, not interpreted), e.g.
    # `tests tests/cache/test_kernel_lowbit.py`: pytest's summary under $OUT/tests.txt
    shift
    files=(); for f in "$@"; do files+=("$OLDPWD/$f"); done
    (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu \
      timeout "${TEST_TIMEOUT:-300}" python3 -P -m pytest -q --maxfail=5 -p no:cacheprovider \
      -p no:benchmark -c "$OLDPWD/pyproject.toml" --rootdir "$OLDPWD" \
      -W ignore::pytest.PytestConfigWarning "${files[@]}" >"$OUT/tests.txt" 2>&1) || true
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.txt" | tail -20 || true ;;
  decode-pallas)  # end to end, Llama-3-8B shapes, bf16, 32K context, one process per row
    # (so each row's allocator peak is its own). Budgets give 20% of the full cache's bytes:
    # qevict's byte budget is 6554 tokens' worth; confkv's INT8 tier fits 12650 tokens in it
    # (row confkv-bf16: confkv without INT8, 6554 BF16 tokens; a -sw suffix writes the decode
    # slots with the one-launch Pallas kernel, write_kernel=pallas, the GPU default since
    # 2026-11-30; confkv-xw writes them with XLA's scatters, for the A/B).
    for b in ${BATCHES:-8 1}; do
      for row in ${ROWS:-full:xla full:pallas confkv:pallas qevict:pallas}; do
        name=${row%%:*} impl=${row##*:}
        pol=$name budget=6554 extra=()
        case $name in
          confkv) budget=12650 ;;
          confkv-bf16) pol=confkv extra=(--no-int8) ;;  # the same bytes, all of them BF16
          confkv-sw) pol=confkv budget=12650 extra=(--set write_kernel=pallas) ;;  # slot_write
          confkv-bf16-sw) pol=confkv extra=(--no-int8 --set write_kernel=pallas) ;;
          confkv-xw) pol=confkv budget=12650 extra=(--set write_kernel=xla) ;;  # XLA scatters
        esac
        run bench decode --preset Llama-3-8B --dtype bfloat16 --policy "$pol" --budget "$budget" \
          "${extra[@]}" --contexts 32768 --batch "$b" --steps "${STEPS:-16}" --copy-mib 4096 \
          --attention "$impl" --out "$OUT/decode_${name}_${impl}_b$b.json"
      done
    done ;;
  mesh)  # the sharded code path on one GPU (--mesh data=1,model=1) against the unsharded one:
    # same shapes, one process per row (Llama-3-8B shapes, bf16, 32K, batch 8); MESHES sets the order
    for row in ${ROWS:-full confkv}; do
      budget=(); [ "$row" = confkv ] && budget=(--budget 12650)
      for mesh in ${MESHES:-none data=1,model=1}; do
        m=(); [ "$mesh" != none ] && m=(--mesh "$mesh")
        timeout "${ROW_TIMEOUT:-150}" bash -c "$(declare -f run); run bench decode --preset Llama-3-8B \
          --dtype bfloat16 --policy $row ${budget[*]} --contexts 32768 --batch 8 \
          --steps ${STEPS:-16} --copy-mib 4096 --attention pallas ${m[*]} \
          --out $OUT/mesh_${row}_${mesh%%=*}.json" || echo "row $row $mesh: exit $?"
      done
    done ;;
  compile-scan)  # first-call seconds of the layer-scan decode loop (compile_times.py --stacked),
    # Llama-3-8B shapes, float32 cache of 8K tokens at B=8 (kvpop's shipped scorer is SmolLM2's)
    (cd /tmp && python3 "$OLDPWD/scripts/compile_times.py" --preset Llama-3-8B --budget 1638 \
      --context 8192 --batch 8 --stacked --policy full window h2o confkv kivi qevict) \
      | tee "$OUT/compile_scan.jsonl" ;;
  decode-scan)  # end to end with the layer scan (--scan-layers: one lax.scan over a stacked
    # cache), Llama-3-8B shapes, bf16, 32K, batch 8, budgets of decode-pallas (20% of full's
    # bytes), one process per row: ms/step, policy ms and first_call_s of the scanned step
    # (EXTRA: more flags for every row, e.g. EXTRA="--set write_kernel=xla" ROWS=confkv).
    # JAX may take 95% of the card: full's 34 GB cache, 16 GB of weights and the fill's buffers
    # do not fit its default 75% of an 80 GB H100 (docs/lab/2026-12-06-h100-decode-gemms.md).
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
    for row in ${ROWS:-full confkv qevict}; do
      budget=(--budget 6554); case $row in confkv) budget=(--budget 12650) ;; full|kivi) budget=() ;; esac
      if [ "$row" = kvpop ]; then
        budget+=(--set scorer="$(llama3_scorer)")
      fi
      timeout "${ROW_TIMEOUT:-75}" bash -c "$(declare -f run); run bench decode --preset Llama-3-8B \
        --dtype bfloat16 --policy $row ${budget[*]} --contexts 32768 --batch ${BATCH:-8} \
        --steps ${STEPS:-16} --copy-mib 4096 --attention pallas --scan-layers ${EXTRA:-} \
        --out $OUT/decode_scan_${row}_b${BATCH:-8}.json" || echo "row $row: exit $?"
    done ;;
  copies)  # cache-sized copies in the compiled policy/decode loops (scripts/find_cache_copies.py)
    shift
    (cd /tmp && python3 "$OLDPWD/scripts/find_cache_copies.py" "$@") | tee -a "$OUT/copies.txt" ;;
  probe)  # the policy's own write and control-flow costs (scripts/policy_step_probe.py ARGS)
    shift
    (cd /tmp && python3 "$OLDPWD/scripts/policy_step_probe.py" "$@") | tee -a "$OUT/probe.txt" ;;
  matmul)  # the decode GEMMs of a layer scan, XLA's dot against the Pallas decode GEMM reading
    # the stacked weights in place (scripts/decode_matmul_probe.py [ROWS] [KNOB=V,V ...])
    shift
    (cd /tmp && XLA_FLAGS="${XLA_FLAGS---xla_gpu_enable_triton_gemm=false}" python3 \
      "$OLDPWD/scripts/decode_matmul_probe.py" "$@") | tee -a "$OUT/matmul.txt" ;;
  trace-policy)  # per-kernel device times of the policy's own write, from a JAX profiler trace
    # (ncu crashed on this probe): trace-policy LAYERS POL:B.. (PROBE_BATCH=1 for batch 1)
    shift
    kvpop_probe "$@"
    (cd /tmp && PROBE_POLICY_ONLY=1 PROBE_TRACE="$OUT/trace" python3 \
      "$OLDPWD/scripts/policy_step_probe.py" "$@") | tee -a "$OUT/trace_policy.txt"
    tar czf "$OUT/trace.tgz" -C "$OUT" trace && rm -rf "$OUT/trace" ;;
  trace-kernel)  # each kernel's device time per call of one bench-kernel row (and XLA's ops
    # around it), from a JAX profiler trace: trace-kernel ROW [BATCH CONTEXT] [KNOB=V ...]
    shift
    (cd /tmp && TRACE="$OUT/ktrace" python3 "$OLDPWD/scripts/profile_kernel.py" "$@") \
      | tee -a "$OUT/trace_kernel.txt"
    rm -rf "$OUT/ktrace" ;;
  trace-decode)  # every kernel's device time per step of the whole decode loop (model, attention,
    # policy): trace-decode LAYERS POL:BUDGET [BATCH] [TUNING_FIELD=V ...] (STACKED=1: the
    # layer-scan step)
    shift
    kvpop_probe "$@"
    (cd /tmp && TRACE=/tmp/dtrace python3 "$OLDPWD/scripts/profile_decode.py" "$@") \
      | tee -a "$OUT/trace_decode.txt"
    rm -rf /tmp/dtrace ;;
  ncu-source)  # every SASS instruction of one kernel row with its executed count and stall
    # samples (ncu's source page, CSV), then the opcode histogram of its main loop:
    # ncu-source ROW [BATCH CONTEXT] [KNOB=V ...]
    shift
    (cd /tmp && ncu --clock-control none -k 'regex:kvjax_decode' --launch-skip 1 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy \
      --section SpeedOfLight --import-source no -f -o /tmp/ncu_src \
      python3 "$OLDPWD/scripts/profile_kernel.py" "$@") >"$OUT/ncu_src_$1.log" 2>&1 || true
    ncu -i /tmp/ncu_src.ncu-rep --page details >>"$OUT/ncu_src_$1.log" 2>&1 || true
    ncu -i /tmp/ncu_src.ncu-rep --page source --csv --print-source sass >"$OUT/sass_$1.csv" 2>&1 || true
    python3 "$OLDPWD/scripts/ncu_sass_histogram.py" "$OUT/sass_$1.csv" | tee "$OUT/sass_$1.txt" || true ;;
  ncu)  # hardware counters of one kernel row: ncu ROW [BATCH CONTEXT] [KNOB=V ...]
    shift
    (cd /tmp && ncu --clock-control none -k 'regex:kvjax_decode' --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
      --section InstructionStats --metrics "${NCU_METRICS:-smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed.sum}" \
      python3 "$OLDPWD/scripts/profile_kernel.py" "$@") >"$OUT/ncu_$1.log" 2>&1 || true
    grep -E "^ +[A-Z].* +[a-z%/]* +[0-9.,]+$|^  [a-z_]+|==PROF==|Error|rror:" "$OUT/ncu_$1.log" | head -120 ;;
  ncu-policy)  # every kernel's time in the policy's own decode write: ncu-policy LAYERS POL:B..
    # (one metric, so one replay pass; every launch is profiled, so the last NCU_LAST are the
    # steady state of the probe's timed loop)
    shift
    (cd /tmp && PROBE_POLICY_ONLY=1 ncu --clock-control none --metrics gpu__time_duration.sum \
      --csv --print-units base --launch-count "${NCU_LAUNCHES:-20000}" \
      python3 "$OLDPWD/scripts/policy_step_probe.py" "$@") >"$OUT/ncu_policy.csv" 2>"$OUT/ncu_policy.err" || true
    python3 "$OLDPWD/scripts/ncu_kernel_times.py" "$OUT/ncu_policy.csv" "${NCU_LAST:-400}" \
      | tee "$OUT/ncu_policy.txt" ;;
  stash)  # a call that only carries one part of the embedded GGUF (each call <= 64 MiB)
    mkdir -p /tmp/parts && cp .gguf-parts/part_* /tmp/parts/ && ls -la /tmp/parts ;;
  quality)  # perplexity sweeps/comparisons on the real model (GGUF reassembled from parts)
    reassemble_gguf
    export JAX_DEFAULT_MATMUL_PRECISION=highest  # float32 matmuls, no TF32, as on CPU
    M=/tmp/smollm2.gguf
    FINAL=$OUT
    OUT=/tmp/quality && mkdir -p "$OUT"
    trap 'tar czf "$FINAL/quality.tgz" -C /tmp quality' EXIT  # one file comes back
    shift
    for job in "$@"; do
      case "$job" in
        sweep)
          for tau in 0.3 0.5 0.7; do for lam in 0 0.1 1.0; do
            run ppl --model $M --policy confkv --budget 256 --tokens 1024 --text addiction.txt \
              --cache-dtype bfloat16 --set tau=$tau --set recency_weight=$lam --json \
              --out "$OUT/sweep_tau${tau}_lam${lam}.json" > /dev/null
          done; done ;;
        compare*)  # compare-W: all rows at the peak live bytes of a W-token window
          w=${job#compare-}
          run compare --model $M --windows "$w" --tokens 2048 --out-dir "$OUT/compare_w$w" \
            --json > /dev/null ;;
        qevict-compare)  # QEvict vs H2O, CONF-KV, KIVI, full at 5/10/20% of the 2048-token cache
          run compare --model $M --windows 102 205 410 --tokens 2048 \
            --rows full h2o confkv+int8 kivi qevict --out-dir "$OUT/compare_qevict" --json > /dev/null
          run compare --model $M --windows 205 --tokens 2048 --rows qevict-int4 \
            --out-dir "$OUT/compare_qevict_int4" --json > /dev/null ;;
        presses-compare)  # CONF-KV, QEvict, KVpop vs the in-loop presses at a 256-window's bytes
          run compare --model $M --windows 256 --tokens 2048 --rows full confkv+int8 qevict \
            kvpop keydiff knorm adakv-keydiff adakv-h2o h2o --out-dir "$OUT/compare_presses" \
            --json > /dev/null ;;
        stream)  # perplexity per 4K chunk over TOKENS of the essays (looped), one token per step,
          # one process and JSON per policy (POLICIES; full stops at the model's 8K context)
          for pol in ${POLICIES:-window streaming h2o confkv qevict kvpop kivi full}; do
            b=(--budget "${BUDGET:-1024}"); case $pol in full|kivi) b=() ;; esac
            run stream --model $M --policy "$pol" "${b[@]}" --tokens "${TOKENS:-204800}" \
              --chunk 4096 --segment 1024 --max-full 8192 --cache-dtype bfloat16 \
              --out "$OUT/stream_$pol.json" --plot "$OUT/stream_$pol.png" --json > /dev/null
          done ;;
        kvpop-grid|qevict-niah)  # the CPU scripts' grids (scripts/kvpop_eval_cpu.sh,
          # scripts/qevict_niah_cpu.sh) through the staged kvjax and the reassembled model
          printf '#!/usr/bin/env bash\ncmd=$1; shift\nexec python3 -P -m kvjax "$cmd" --model %s "$@"\n' \
            "$M" > /tmp/kvm && chmod +x /tmp/kvm
          case $job in
            kvpop-grid) KV=/tmp/kvm OUT="$OUT/kvpop_eval" bash scripts/kvpop_eval_cpu.sh ;;
            qevict-niah) KV=/tmp/kvm OUT="$OUT/niah_qevict_2k" bash scripts/qevict_niah_cpu.sh ;;
          esac ;;
        niah-256)  # NIAH at one shared budget (256), 1K and 2K, both protocols
          run niah --model $M --policy window streaming h2o snapkv confkv --budget 256 \
            --lengths 1024 2048 --depths 0 25 50 75 100 --protocol both \
            --out-dir "$OUT/niah_b256" --json > /dev/null ;;
        niah-4k)  # budgeted policies where the full cache still solves most depths
          run niah --model $M --policy streaming h2o confkv --budget 1024 --lengths 4096 \
            --depths 0 25 50 75 100 --protocol both --out-dir "$OUT/niah_b1024" --json > /dev/null ;;
        *) echo "unknown job $job" >&2; exit 2 ;;
      esac
    done ;;
  stream) exec "$0" quality stream ;;  # `quality stream`: the long-stream evaluation
  stream-par)  # the long-stream evaluation with POLICIES run at once, one process each sharing
    # the GPU (no preallocation); JSON and a stderr log per policy straight under $OUT, so a
    # run cut by its time limit still returns every finished policy and each one's last chunk
    reassemble_gguf
    export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
    # SET=FIELD=VALUE passes `--set` to every policy and tags the file names
    # (SET=position_shift=true: positions within the cache, for streaming, the ranked policies
    # and qevict; window, full and kivi refuse it, so leave them out of POLICIES)
    tag=${SET:+_${SET//[^A-Za-z0-9]/_}}; s=(); [ -n "${SET:-}" ] && s=(--set "$SET")
    for pol in ${POLICIES:-window streaming h2o confkv qevict kvpop kivi full}; do
      b=(--budget "${BUDGET:-1024}"); case $pol in full|kivi) b=() ;; esac
      run stream --model /tmp/smollm2.gguf --policy "$pol" "${b[@]}" "${s[@]}" \
        --tokens "${TOKENS:-204800}" --chunk 4096 --segment "${SEGMENT:-1024}" --max-full 8192 \
        --cache-dtype bfloat16 --out "$OUT/stream_$pol$tag.json" --json > /dev/null \
        2> "$OUT/stream_$pol$tag.log" &
    done
    wait
    grep -h "stream \[" "$OUT"/stream_*.log | tail -40 || true ;;
  ruler-par)  # the RULER-style grid with policy RGROUPS (";"-separated) run at once (par_groups);
    # each group's ruler.json is rewritten after every cell, so a run cut by its time limit keeps
    # every finished cell. TASKS, LENGTHS, RATIOS, SAMPLES as `kvjax ruler` takes them.
    # shellcheck disable=SC2086
    par_groups ruler "${RGROUPS:-full streaming;h2o tova;snapkv adakv-snapkv;pyramidkv chunkkv;knorm keydiff;kvzip;expected random;kvpop adakv-keydiff}" \
      --ratios ${RATIOS:-0.5 0.75} --tasks ${TASKS:-niah_single_1 niah_multikey_1 niah_multivalue vt} \
      --lengths ${LENGTHS:-1024 2048 4096} --samples "${SAMPLES:-5}" --max-new-tokens 24 ;;
  niah-par)  # the NIAH grid (LENGTHS x 5 depths, PROTOCOL: query-aware, query-agnostic, both
    # (default), press (kvpress's compress-once; full-precision policies) or all) at RATIOS
    # with policy NGROUPS (";"-separated) run at once (par_groups); a group's results are written
    # when each (policy, ratio, protocol) finishes all its cells (one table and plot from them:
    # scripts/merge_ruler_json.py OUT.png niah/PROTOCOL FILES...). Each group runs with
    # --scan-layers (the grid is compile-bound: one compiled layer instead of 30;
    # docs/compile.md) but a group naming pyramidkv, whose per-layer budgets cannot scan; SCAN=0:
    # every group unrolled.
    niah_groups=
    IFS=';' read -ra ngroups <<< "${NGROUPS:-full streaming;h2o;tova;snapkv;knorm;keydiff;confkv;qevict;kvpop;kivi}"
    for grp in "${ngroups[@]}"; do
      case " $grp " in *" pyramidkv "*) ;; *) [ "${SCAN:-1}" = 0 ] || grp+=" --scan-layers" ;; esac
      niah_groups+="${niah_groups:+;}$grp"
    done
    # shellcheck disable=SC2086
    par_groups niah "$niah_groups" \
      --ratios ${RATIOS:-0.25 0.5 0.75 0.875} --lengths ${LENGTHS:-1024 2048 4096} \
      --depths 0 25 50 75 100 --protocol "${PROTOCOL:-both}" ;;
  stream-flags)  # ms/token of a short stream (TOKENS, default 16384) of one POLICY under each
    # XLA_FLAGS variant (one process each; the step is launch-bound at SmolLM2's size, so XLA's
    # command buffers — CUDA graphs, also of while loops — may cut it): variants "base"
    # (no flags), "graphs" (command buffers for fusions, GEMMs, custom calls), "graphs+while"
    reassemble_gguf
    export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
    pol=${POLICY:-streaming}; b=(--budget "${BUDGET:-1024}"); case $pol in full|kivi) b=() ;; esac
    cb="--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
    for variant in ${VARIANTS:-base graphs graphs+while}; do
      case $variant in
        base) flags="" ;;
        graphs) flags="$cb" ;;
        graphs+while) flags="$cb,WHILE,CONDITIONAL" ;;
        *) echo "unknown variant $variant" >&2; exit 2 ;;
      esac
      XLA_FLAGS="$flags" timeout "${ROW_TIMEOUT:-150}" bash -c "$(declare -f run); run stream \
        --model /tmp/smollm2.gguf --policy $pol ${b[*]} --tokens ${TOKENS:-16384} --chunk 4096 \
        --segment ${SEGMENT:-1024} --max-full 8192 --cache-dtype bfloat16 --compilation-cache off \
        --out $OUT/stream_flags_${pol}_$variant.json --json" > /dev/null \
        2> "$OUT/stream_flags_${pol}_$variant.log" || echo "variant $variant: exit $?"
      grep -h "stream \[" "$OUT/stream_flags_${pol}_$variant.log" | tail -2 | sed "s/^/$variant: /" || true
    done ;;
  *) echo "unknown suite $1" >&2; exit 2 ;;
esac
