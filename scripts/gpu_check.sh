#!/usr/bin/env bash
# `make gpu-check`: everything that needs the GPU, on the GPU machine (no package registry
# there): GPU tests, the demo on CUDA, compute-sanitizer on the kernels, then benchmarks.
# Uses the machine's python3 (CuPy, torch, grpcio...) plus wheels carried in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
# $OUT receives two files (the device tool returns at most 8): results.tgz, holding
# bench/results/ with this run's logs under gpu-logs/, and the regenerated PERFORMANCE.md.
OUT="${OUT:-bench/results/gpu-check}"
LOG=bench/results/gpu-logs
mkdir -p "$OUT" "$LOG"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dpu-site .whl/*.whl || { echo "gpu-check: wheel install failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/dpu-site:$PWD" PATH="/tmp/dpu-site/bin:$PATH"
else
  export PYTHONPATH="$PWD"
fi
STAGES="${GPU_CHECK_STAGES:-tests fuzz demo sanitizer bench}"
fail=0
stage() { echo "=== $1"; }
# Results travel back after every stage, so a run cut short by its time limit still returns them.
save() { tar czf "$OUT/results.tgz" -C bench/results --exclude gpu-check . 2>/dev/null; }
nvidia-smi -L || { echo "gpu-check: no GPU" >&2; exit 1; }
python3 -c "import cupy, grpc, google.protobuf, zmq; print('cupy', cupy.__version__, 'grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'zmq', zmq.__version__)" || exit 1

for s in $STAGES; do
  case "$s" in
  tests)
    stage "pytest (CPU and GPU tests)"
    timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider --timeout-method=thread ${GPU_PYTEST_ARGS:-tests} 2>&1 | tee "$LOG/pytest.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || fail=1 ;;
  fuzz)
    stage "hypothesis: descriptors and packets, CUDA kernels against their twins"
    # The first line says where and what ran; bench/reliability_report.py counts from this log.
    # GPU_FUZZ_APPEND=1 adds to the log an earlier call began (one profile over two calls),
    # refused unless that log's first line names this source and profile.
    line=$(python3 -c "import datetime, cupy; from bench.common import source_hash; print('# fuzz-gpu', datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d'), cupy.cuda.runtime.getDeviceProperties(0)['name'].decode(), 'source', source_hash(), 'profile', '${GPU_FUZZ_PROFILE:-fuzz}')")
    if [ "${GPU_FUZZ_APPEND:-0}" = 1 ]; then
      first=$(head -1 "$LOG/fuzz-gpu.log" 2>/dev/null)
      [ "${first#* source }" = "${line#* source }" ] \
        || { echo "gpu-check: GPU_FUZZ_APPEND=1 but $LOG/fuzz-gpu.log is not this source's and profile's" >&2; exit 2; }
    else
      echo "$line" > "$LOG/fuzz-gpu.log"
    fi
    # One process per target: in one process the resident receiver's fuzz, run after the
    # persistent descriptor kernel's, ran past 70 s where alone it takes 31 (H100, 2026-12-07).
    for target in ${GPU_FUZZ_TARGETS:-tests/fuzz/test_fuzz_gpu.py tests/fuzz/test_fuzz_gpu_packets.py tests/fuzz/test_fuzz_gpu_serve.py}; do
      HYPOTHESIS_PROFILE="${GPU_FUZZ_PROFILE:-fuzz}" timeout "${FUZZ_TIMEOUT:-540}" \
        python3 -m pytest -q -p no:cacheprovider --timeout-method=thread --timeout "${FUZZ_TIMEOUT:-540}" \
        "$target" --hypothesis-show-statistics 2>&1 | tee -a "$LOG/fuzz-gpu.log" | tail -6
      [ "${PIPESTATUS[0]}" = 0 ] || fail=1
      save
    done ;;
  demo)
    stage "demo on CUDA"
    timeout "${DEMO_TIMEOUT:-180}" python3 examples/demo.py --device cuda 2>&1 | tee "$LOG/demo.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || fail=1 ;;
  sanitizer)
    stage "compute-sanitizer memcheck and racecheck on the kernel suites"
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_moe_kernels.py tests/test_landed.py \
        > "$LOG/sanitizer-$tool.log" 2>&1
      rc=$?
      tail -4 "$LOG/sanitizer-$tool.log"
      if grep -q "Device not supported" "$LOG/sanitizer-$tool.log"; then
        echo "compute-sanitizer $tool: not supported on this machine's runtime (not run)"
      elif [ "$rc" != 0 ]; then fail=1; fi
    done ;;
  layers)
    # What a grouped-GEMM group costs here (empty ones included), then a transformers layer's
    # parts with the pool as one set of groups and cut into a home per layer.
    stage "grouped GEMM per group; a transformers layer's parts, with and without homes"
    timeout "${BENCH_TIMEOUT:-240}" python3 bench/grouped_mm.py 2>&1 | tee "$LOG/bench-grouped_mm.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || fail=1
    save
    for homes in "" --layer-homes; do
      timeout "${BENCH_TIMEOUT:-240}" python3 bench/layer_parts.py --device cuda --cache 0.5 \
        --new-tokens 32 $homes 2>&1 | tee "$LOG/bench-layer_parts$homes.log" | tail -16
      [ "${PIPESTATUS[0]}" = 0 ] || fail=1
      save
    done ;;
  profile)
    stage "cProfile of the offload decode loop's main thread (Qwen3 shapes, 25% cache)"
    rm -f "$LOG/profile-decode.txt"
    timeout "${BENCH_TIMEOUT:-240}" python3 bench/decode.py --device cuda --gpu-cache-fraction 0.25 \
      ${DECODE_ARGS:-} --no-save --profile "$LOG/profile-decode.txt" 2>&1 | tail -3
    head -45 "$LOG/profile-decode.txt" ;;
  bench)
    stage "benchmarks"
    for b in ${GPU_BENCHES:-delivery moe_kernels decode activations}; do
      runs=("")
      [ "$b" = decode ] && read -ra runs <<< "${DECODE_ARCHS:-qwen3-30b-a3b deepseek-v3-lite}"
      for arch in "${runs[@]}"; do
        args=(--device cuda)
        [ "$b" = delivery ] && args+=(${DELIVERY_ARGS:-})
        [ "$b" = decode ] && args+=(--arch "$arch" ${DECODE_ARGS:-})
        [ "$b" = transformers_decode ] && args+=(${TRANSFORMERS_ARGS:-})
        timeout "${BENCH_TIMEOUT:-240}" python3 "bench/$b.py" "${args[@]}" 2>&1 | tee "$LOG/bench-$b$arch.log" | tail -8
        [ "${PIPESTATUS[0]}" = 0 ] || fail=1
        save
      done
    done
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      timeout "${BENCH_TIMEOUT:-240}" python3 bench/multi_gpu.py --device cuda 2>&1 | tee "$LOG/bench-multi_gpu.log" | tail -4
      [ "${PIPESTATUS[0]}" = 0 ] || fail=1
    fi ;;
  spy)
    # py-spy (carried in .whl/: `make wheels`) over one benchmark: its own process's threads
    # (the host client) and, attached once they start, the agent's, the DMA engine's and the
    # NIC stand-in's. Raw stacks (a line a stack, its sample count last): gpu-logs/spy-*.txt.
    spy_args="${SPY_ARGS:-bench/delivery.py --device cuda --shapes qwen3-30b-a3b-9.4MB --mechanisms engine --experts 8 --repeats 3}"
    stage "py-spy of $spy_args"
    command -v py-spy >/dev/null || { echo "gpu-check: py-spy not carried (make wheels)" >&2; exit 2; }
    rm -f "$LOG"/spy-*.txt
    py-spy record --threads --idle --rate "${SPY_RATE:-100}" --format raw -o "$LOG/spy-client.txt" -- python3 \
      $spy_args > "$LOG/spy-bench.log" 2>&1 &
    bench=$!
    for who in "agent:dpu_agent.cli serve" "engine:-m dma_engine" "nic:-m nic --listen"; do
      (  # each waited for apart: a benchmark starts only some of them
        pid=""
        for _ in $(seq 240); do pid=$(pgrep -f -- "${who#*:}" | head -1); [ -n "$pid" ] && break; sleep 0.25; done
        [ -z "$pid" ] || exec py-spy record --threads --idle --rate "${SPY_RATE:-100}" --format raw --nonblocking \
          -o "$LOG/spy-${who%%:*}.txt" --pid "$pid" --duration "${SPY_SECONDS:-60}" > /dev/null 2>&1
      ) &
    done
    wait "$bench" || fail=1
    wait
    tail -6 "$LOG/spy-bench.log"
    for raw in "$LOG"/spy-{client,agent,engine,nic}.txt; do  # a summary of each, beside it
      [ -f "$raw" ] && python3 bench/spy_report.py "$raw" > "${raw%.txt}-report.txt"
    done
    head -30 "$LOG/spy-agent-report.txt" 2>/dev/null ;;
  ab)
    # An interleaved A/B on this machine (bench/ab.py run's arguments, split on spaces), its
    # table in gpu-logs/ab-$AB_NAME.log; each side's runs overwrite that benchmark's results.
    [ -n "${AB_ARGS:-}" ] || { echo "gpu-check: the ab stage needs AB_ARGS (bench/ab.py run's arguments)" >&2; exit 2; }
    stage "interleaved A/B: bench/ab.py run $AB_ARGS"
    timeout "${AB_TIMEOUT:-480}" python3 bench/ab.py run $AB_ARGS 2>&1 | tee "$LOG/ab-${AB_NAME:-gpu}.log" | tail -20
    [ "${PIPESTATUS[0]}" = 0 ] || fail=1 ;;
  setup)
    stage "setup only: the carried wheels are in /tmp/dpu-site" ;;
  *)
    echo "gpu-check: unknown stage '$s' (tests fuzz demo sanitizer bench profile spy ab setup)" >&2
    exit 2 ;;
  esac
  save
done
python3 bench/report.py >/dev/null && cp docs/PERFORMANCE.md "$OUT/" 2>/dev/null
save
echo "=== gpu-check: $([ $fail = 0 ] && echo PASSED || echo FAILED)"
exit $fail
