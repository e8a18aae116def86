#!/usr/bin/env bash
# Run the metrale GPU bundle: bash run.sh LOGDIR  (written by `cargo xtask gpu-bundle`).
# Needs the NVIDIA driver; CUDA's tools (compute-sanitizer) are used when found.
#
# Runs every test binary (one test at a time, output uncaptured; the tests named *on_two_gpus
# apart, in the tensor-parallel section, which runs on a machine with 2 GPUs or more:
# TP_TESTS=1 forces it, TP_TESTS=0 skips it); the kernel tests' sanitizer sets
# (`__SANITIZED__ __SANITIZER_SET__`: every kernel at small shapes, under compute-sanitizer's
# memcheck; `__RACECHECK_SET__`, the same but `linear_stream_tma`, under racecheck), each within
# SANITIZER_TIMEOUT; the kernel measurements (bin/kernel_bench); the CLI's benchmark, its
# FP8, FP8-KV, speculative, serving and interference figures and a smoke run (each section has
# its switch: FP8_BENCH, KV_BENCH, SPEC_BENCH, SERVE_BENCH, INTERF_BENCH; 0 skips it); the
# tensor-parallel benchmark on 2 GPUs (TP_BENCH, on with the
# tensor-parallel section); the soak. Writes each full log and results.json to LOGDIR and prints
# a short summary last. Exits non-zero if anything failed.
#
# NCCL (the tensor-parallel collectives): its NVLink multicast reductions (NVLS) stay off
# (NCCL_NVLS_ENABLE=0: they need cuMulticastCreate and do not repeat bit for bit), and the
# nvidia-nccl-cu13 wheel's library (else the system's libnccl.so.2) is linked as libnccl.so, the
# name the engine's loader looks for, in a directory put on LD_LIBRARY_PATH.
set -uo pipefail
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOGDIR="${1:?usage: run.sh LOGDIR}"
mkdir -p "$LOGDIR"
LOGDIR="$(cd "$LOGDIR" && pwd)"
# The executables travel compressed (payload.tar.xz); unpack them into a scratch directory.
BIN_ROOT="$(mktemp -d "${TMPDIR:-/tmp}/metrale-bundle.XXXXXX")"
trap 'rm -rf "$BIN_ROOT"' EXIT
tar -xJf "$BUNDLE/payload.tar.xz" -C "$BIN_ROOT" || { echo "run.sh: cannot unpack $BUNDLE/payload.tar.xz" >&2; exit 2; }
# Run from the working tree's root (target/gpu-bundle/../..), where tests/fixtures lives.
cd "$BUNDLE/../.."
[ -d tests/fixtures ] || { echo "run.sh: no tests/fixtures under $(pwd): run the bundle inside its working tree" >&2; exit 2; }
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"

export NCCL_NVLS_ENABLE=0
NCCL_LINK_DIR="$BIN_ROOT/nccl"
mkdir -p "$NCCL_LINK_DIR"
NCCL_LIB="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)/lib"
for lib in "$NCCL_LIB/libnccl.so.2" /usr/lib/x86_64-linux-gnu/libnccl.so.2; do
  if [ -e "$lib" ]; then
    ln -sf "$lib" "$NCCL_LINK_DIR/libnccl.so"
    export LD_LIBRARY_PATH="$NCCL_LINK_DIR:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "NCCL: $lib" > "$LOGDIR/nccl.txt"
    break
  fi
done
[ -e "$NCCL_LINK_DIR/libnccl.so" ] || echo "NCCL: not found (the tensor-parallel tests will say so)" > "$LOGDIR/nccl.txt"
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
TP_TESTS="${TP_TESTS:-$([ "${GPUS:-0}" -ge 2 ] && echo 1 || echo 0)}"
SANITIZER_TIMEOUT="${SANITIZER_TIMEOUT:-300}"

declare -a ROWS=()
declare -a SANITIZED=()
JSON="$LOGDIR/results.json"
echo "[" > "$JSON"
FIRST=1
FAILED=0

record() { # name status passed failed seconds log
  ROWS+=("$(printf '%-28s %-8s %7s %7s %9s' "$1" "$2" "$3" "$4" "$5")")
  [ $FIRST -eq 1 ] || echo "," >> "$JSON"
  FIRST=0
  printf '  {"name": "%s", "status": "%s", "passed": %s, "failed": %s, "seconds": %s, "log": "%s"}' \
    "$1" "$2" "$3" "$4" "$5" "$6" >> "$JSON"
  [ "$2" = "ok" ] || FAILED=1
}

counts() { # log -> "passed failed" summed over every `test result:` line
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
       END { printf "%d %d", p, f }' "$1"
}

status_of() { # exit code -> ok / fail(N) / timeout
  case "$1" in
    0) echo ok ;;
    124) echo timeout ;;
    *) echo "fail($1)" ;;
  esac
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

{ nvidia-smi || true; } > "$LOGDIR/nvidia-smi.txt" 2>&1

for t in "$BIN_ROOT"/tests/bin/*; do
  [ -x "$t" ] || continue
  name="$(basename "$t")"
  log="$LOGDIR/$name.log"
  start="$(now)"
  timeout "$TEST_TIMEOUT" "$t" --test-threads=1 --nocapture --skip on_two_gpus > "$log" 2>&1
  rc=$?
  secs="$(elapsed "$start")"
  read -r passed failed < <(counts "$log")
  record "$name" "$(status_of $rc)" "$passed" "$failed" "$secs" "$log"
done

# Tensor parallelism over 2 GPUs (the tests named *on_two_gpus; they fail, saying so, on a
# machine with fewer GPUs): with TP_TESTS=1, by default where nvidia-smi lists 2 GPUs or more.
for t in "$BIN_ROOT"/tests/bin/*; do
  [ -x "$t" ] || continue
  "$t" --list 2>/dev/null | grep -q 'on_two_gpus: test' || continue
  name="$(basename "$t") on_two_gpus"
  log="$LOGDIR/$(basename "$t")-on_two_gpus.log"
  if [ "$TP_TESTS" != 1 ]; then
    echo "skipped: ${GPUS:-0} GPU(s) listed (TP_TESTS=1 runs it anyway)" > "$log"
    record "$name" "skipped" 0 0 0 "$log"
    continue
  fi
  start="$(now)"
  timeout "$TEST_TIMEOUT" "$t" on_two_gpus --test-threads=1 --nocapture > "$log" 2>&1
  rc=$?
  secs="$(elapsed "$start")"
  read -r passed failed < <(counts "$log")
  status="$(status_of $rc)"
  [ "$passed" -gt 0 ] || status="${status/ok/no-tests}"
  record "$name" "$status" "$passed" "$failed" "$secs" "$log"
done

# compute-sanitizer over the kernel tests' sanitizer sets: memcheck (device memory errors) and
# racecheck (shared-memory hazards). Host API errors are not reported: they are the backend's
# own `GpuError`s.
SAN=""
for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer; do
  if command -v "$c" > /dev/null 2>&1; then SAN="$c"; break; fi
done
for tool in memcheck racecheck; do
  [ -x "$BIN_ROOT/tests/bin/__SANITIZED__" ] || break
  log="$LOGDIR/$tool.log"
  if [ -z "$SAN" ]; then
    echo "compute-sanitizer not found" > "$log"
    record "$tool" "skipped" 0 0 0 "$log"
    SANITIZED+=("$tool: skipped (no compute-sanitizer)")
    continue
  fi
  # racecheck runs its own set, which leaves out `linear_stream_tma` (the set's file says why).
  set="__SANITIZER_SET__"
  [ "$tool" = racecheck ] && set="__RACECHECK_SET__"
  start="$(now)"
  timeout "$SANITIZER_TIMEOUT" "$SAN" --tool "$tool" --report-api-errors no --error-exitcode 86 \
    "$BIN_ROOT/tests/bin/__SANITIZED__" "$set" --test-threads=1 > "$log" 2>&1
  rc=$?
  secs="$(elapsed "$start")"
  read -r passed failed < <(counts "$log")
  if [ "$tool" = memcheck ]; then
    found="$(grep -o -E 'ERROR SUMMARY: [0-9]+ error' "$log" | tail -n 1 | grep -o -E '[0-9]+' || true)"
    unit=errors
  else
    found="$(grep -o -E 'RACECHECK SUMMARY: [0-9]+ hazard' "$log" | tail -n 1 | grep -o -E '[0-9]+' || true)"
    unit=hazards
  fi
  status="$(status_of $rc)"
  # A run that passed but reported no summary line did not run under the tool as expected.
  [ "$status" = ok ] && [ -z "$found" ] && status="no-summary"
  [ "$passed" -gt 0 ] || status="${status/ok/no-tests}"
  record "$tool" "$status" "$passed" "$failed" "$secs" "$log"
  SANITIZED+=("$tool: ${found:-?} $unit in ${secs} s ($status)")
done

if [ -x "$BIN_ROOT/bin/kernel_bench" ]; then
  log="$LOGDIR/kernel-bench.log"
  start="$(now)"
  timeout "$TEST_TIMEOUT" "$BIN_ROOT/bin/kernel_bench" > "$log" 2>&1
  record "kernel_bench" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
fi

if [ -x "$BIN_ROOT/bin/metrale" ]; then
  log="$LOGDIR/metrale-cli.log"
  start="$(now)"
  timeout 60 "$BIN_ROOT/bin/metrale" --help > "$log" 2>&1
  record "metrale --help" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  # The benchmark (BENCH_SHAPES, default qwen3-8b and qwen3.5-9b): each figure beside its roofline.
  for shape in ${BENCH_SHAPES:-qwen3-8b qwen3.5-9b}; do
    log="$LOGDIR/bench-$shape.log"
    start="$(now)"
    timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --shape "$shape" --backend cuda \
      --json-out "$LOGDIR/bench-$shape.json" > "$log" 2>&1
    record "bench $shape" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  done
  # The block-FP8 figures (FP8_BENCH=0 skips them): the dense and hybrid shapes quantized at
  # load, and the sparse-MoE Qwen3.5-35B-A3B shape in bf16 and in FP8 (its floor counts the
  # experts each batch reads).
  if [ "${FP8_BENCH:-1}" != 0 ]; then
    for run in qwen3-8b:fp8 qwen3.5-9b:fp8 qwen3.5-35b-a3b:none qwen3.5-35b-a3b:fp8; do
      shape="${run%%:*}"
      quant="${run##*:}"
      log="$LOGDIR/bench-$shape-$quant.log"
      start="$(now)"
      timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --shape "$shape" --backend cuda \
        --quantization "$quant" --json-out "$LOGDIR/bench-$shape-$quant.json" > "$log" 2>&1
      record "bench $shape $quant" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
    done
  fi
  # The KV cache's formats on Qwen3-8B (KV_BENCH=0 skips them): decode at batch 1, context
  # 1024 and at batch 32, context 8192, with bf16 and with FP8 (e4m3) keys and values.
  if [ "${KV_BENCH:-1}" != 0 ]; then
    for kv in bf16 fp8; do
      for run in 1:1024 32:8192; do
        batch="${run%%:*}"; context="${run##*:}"
        log="$LOGDIR/bench-kv-$kv-b$batch-ctx$context.log"
        start="$(now)"
        timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --shape qwen3-8b --backend cuda \
          --kv-cache-dtype "$kv" --batches "$batch" --breakdown-batches "$batch" --context "$context" \
          --json-out "$LOGDIR/bench-kv-$kv-b$batch-ctx$context.json" > "$log" 2>&1
        record "bench kv $kv b$batch ctx$context" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
      done
    done
  fi
  # The speculative figures on the hybrid shape (SPEC_BENCH=0 skips them): verify and draft
  # steps beside a plain decode step, projected and end-to-end tokens/s (legacy forward); then
  # under the circuit forward with verify steps of 4 sequences (its batched verify programs).
  if [ "${SPEC_BENCH:-1}" != 0 ]; then
    for forward in legacy circuit; do
      batch=1; [ "$forward" = circuit ] && batch=4
      name="spec-bench-qwen3.5-9b-$forward-b$batch"
      log="$LOGDIR/$name.log"
      start="$(now)"
      timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --speculative --shape qwen3.5-9b \
        --backend cuda --num-draft-tokens 4 --speculative-forward "$forward" \
        --speculative-batch "$batch" --json-out "$LOGDIR/$name.json" > "$log" 2>&1
      record "bench --speculative $forward b$batch" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
    done
  fi
  # Tensor parallelism over 2 GPUs through NCCL (TP_BENCH=1 runs it, TP_BENCH=0 skips it; by
  # default with the tensor-parallel tests): decode at batch 1 and 32, each step beside its
  # floor per GPU, on Qwen3-32B and the Qwen3-Next-80B-A3B-shaped hybrid MoE.
  if [ "${TP_BENCH:-$TP_TESTS}" = 1 ]; then
    for shape in qwen3-32b qwen3-next-80b-a3b; do
      log="$LOGDIR/bench-tp2-$shape.log"
      start="$(now)"
      timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --shape "$shape" --backend cuda \
        --tensor-parallel-size 2 --batches 1,32 --json-out "$LOGDIR/bench-tp2-$shape.json" > "$log" 2>&1
      record "bench tp2 $shape" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
    done
  fi
fi

# The serving figures (SERVE_BENCH=0 skips them): on Qwen3-8B the ladder's rung of 32 requests,
# plain and with one under a JSON schema, and the trace at 4 and 16 requests a second; on
# Qwen3.5-9B the speculative ladder (each rung plain, then with the oracle's drafts and the MTP
# head's behind the gate, K = 3).
if [ -x "$BIN_ROOT/bin/metrale" ] && [ "${SERVE_BENCH:-1}" != 0 ]; then
  log="$LOGDIR/serve-constrained-qwen3-8b.log"
  start="$(now)"
  timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --serve --shape qwen3-8b \
    --backend cuda --concurrency 32 --constrained 1 \
    --json-out "$LOGDIR/serve-constrained-qwen3-8b.json" > "$log" 2>&1
  record "bench --serve --constrained" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  log="$LOGDIR/serve-trace-qwen3-8b.log"
  start="$(now)"
  timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --serve --shape qwen3-8b \
    --backend cuda --request-rate 4,16 --json-out "$LOGDIR/serve-trace-qwen3-8b.json" > "$log" 2>&1
  record "bench --serve --request-rate" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  log="$LOGDIR/serve-speculative-qwen3.5-9b.log"
  start="$(now)"
  timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --serve --speculative \
    --shape qwen3.5-9b --backend cuda --concurrency 1,2,4,8,16,32,64 --num-draft-tokens 3 \
    --json-out "$LOGDIR/serve-speculative-qwen3.5-9b.json" > "$log" 2>&1
  record "bench --serve --speculative" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
fi

# The interference scenario (INTERF_BENCH=0 skips it): 64 streams decode when a prompt of
# 16,384 tokens arrives, mixed steps on and off; on Qwen3-8B the mixed chunks unbounded, bounded
# by budgets of attention work (query-row by key pairs) and paced to 175 % of a plain decode
# step, on Qwen3.5-9B paced. The streams decode 1,536 tokens (on Qwen3-8B paced at 175 % the
# prompt still outlasts them, and its TTFT then counts steps of its chunks alone).
if [ -x "$BIN_ROOT/bin/metrale" ] && [ "${INTERF_BENCH:-1}" != 0 ]; then
  for run in qwen3-8b:none qwen3-8b:500000 qwen3-8b:1000000 qwen3-8b:2000000 \
    qwen3-8b:paced175 qwen3.5-9b:paced175; do
    shape="${run%%:*}"; chunks="${run#*:}"
    log="$LOGDIR/interference-$shape-$chunks.log"
    case "$chunks" in
      none) budget=() ;;
      paced*) budget=(--mixed-step-slowdown-pct "${chunks#paced}") ;;
      *) budget=(--mixed-chunk-attention "$chunks") ;;
    esac
    start="$(now)"
    timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --serve --shape "$shape" \
      --backend cuda --concurrency 64 --interference-prompt-tokens 16384 --output-tokens 1536 \
      "${budget[@]}" --json-out "$LOGDIR/interference-$shape-$chunks.json" > "$log" 2>&1
    record "interference $shape $chunks" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  done
fi

# The soak (many concurrent requests with cancellations, shared prefixes and preemption; every
# output checked against its solo run) on the CUDA engine, over the dense and hybrid fixtures,
# with a bf16 and with an FP8 KV cache.
if [ -x "$BIN_ROOT/bin/xtask" ]; then
  log="$LOGDIR/soak-cuda.log"
  start="$(now)"
  timeout "${SOAK_TIMEOUT:-300}" "$BIN_ROOT/bin/xtask" soak --backend cuda \
    --model tests/fixtures/qwen3-tiny --model tests/fixtures/qwen3_5-tiny > "$log" 2>&1
  record "soak cuda" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
  log="$LOGDIR/soak-cuda-fp8-kv.log"
  start="$(now)"
  timeout "${SOAK_TIMEOUT:-300}" "$BIN_ROOT/bin/xtask" soak --backend cuda --kv-cache-dtype fp8 \
    --model tests/fixtures/qwen3-tiny --model tests/fixtures/qwen3_5-tiny > "$log" 2>&1
  record "soak cuda fp8 kv" "$(status_of $?)" 0 0 "$(elapsed "$start")" "$log"
fi

echo "" >> "$JSON"
echo "]" >> "$JSON"

# Per-kernel worst errors printed by the kernel tests (`kernel-check` lines).
grep -h -o 'kernel-check.*' "$LOGDIR"/*.log 2>/dev/null > "$LOGDIR/kernel-errors.txt" || true
if [ -s "$LOGDIR/kernel-errors.txt" ]; then
  echo "== worst error per kernel (tests/bin/__SANITIZED__) =="
  grep -h -o 'kernel-check.*' "$LOGDIR/__SANITIZED__.log" 2>/dev/null || true
fi
for f in "$LOGDIR"/bench-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 12 "$f"; }
done
for f in "$LOGDIR"/serve-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 8 "$f"; }
done
for f in "$LOGDIR"/interference-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 4 "$f"; }
done
for f in "$LOGDIR"/spec-bench-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 46 "$f"; }
done
if grep -q '^bench' "$LOGDIR/kernel-bench.log" 2>/dev/null; then
  echo "== kernel measurements =="
  grep -h '^bench' "$LOGDIR/kernel-bench.log"
fi
echo "== failures =="
grep -h -A1 -E 'panicked at' "$LOGDIR"/*.log 2>/dev/null | grep -v -E '^(--|stack backtrace:)$' | head -n 40 || true
grep '^NOT BUILT' "$BUNDLE/manifest.txt" 2>/dev/null || true
if [ ${#SANITIZED[@]} -gt 0 ]; then
  echo "== sanitizers (tests/bin/__SANITIZED__ __SANITIZER_SET__ / __RACECHECK_SET__) =="
  for r in "${SANITIZED[@]}"; do echo "$r"; done
fi
echo "== summary (logs in $LOGDIR) =="
printf '%-28s %-8s %7s %7s %9s\n' "binary" "status" "passed" "failed" "seconds"
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
