#!/usr/bin/env bash
# The CUDA backend on a GPU machine in one command: build, GPU tests, compute-sanitizer, benchmark.
#
#   tools/cuda_device_check.sh [build] [tests] [sanitize] [bench] [quickbench] [prefix] [continue] [mtp] [mtp-full] [trace]
#                              [ab] [ncu] [delta]
#   (default: build tests)
#
# tests: tests/cuda, or the files in TEST_PATHS; TEST_K selects by a pytest -k expression (one argument, spaces
# and all: PYTEST_ARGS is split on spaces).
# bench: the full sweep (benchmarks/bench_cuda.py; BENCH_ARGS adds arguments, e.g. "--repeats 3 --decode-tokens 64",
# the published sweeps' command, ~160 s on an H100).
# trace: the decode critical path at TRACE_CONTEXT positions (default 4096): benchmarks/trace_cuda.py.
# ab: decode tokens/s of each backend-options JSON in AB_OPTIONS (';'-separated; the first is the baseline) at
# AB_CONTEXTS (default 4K; none: no decode), AB_ROUNDS interleaved rounds (default 5), and prefill tokens/s at the
# prompt lengths in AB_PREFILL (default none; AB_PREFILL_SESSION=reuse: one session per engine, reset before each
# prefill): benchmarks/ab_decode.py.
# quickbench: prefill at 512 and 4K, decode at 256 and 4K, for each backend-options JSON in QB_OPTIONS (';'-separated,
# default {}), in turn, QB_ROUNDS times (default 1).
# continue: a continued conversation's time to first token, the pending token folded into the prefill or fed by a
# decode step first (benchmarks/bench_continue.py), on lily-tiny at 8K and the full-size model at 4K.
# delta: the prefill DeltaNet op alone per form (tensor cores, fp32 FMAs, the sequential scan) at DELTA_ROWS (default
# 4096,16384): benchmarks/bench_cuda_delta.py; no checkpoint needed.
# ncu: Nsight Compute's detailed sections (stall reasons, memory, occupancy, source hot spots) for the decode
# kernels matching NCU_KERNELS (a regex; default the two decode MoE kernels) in the full-size model's decode steps.
#
# Builds the extension with CMake into /tmp/lily-cuda-build (no pip, no network), assembles the package in
# /tmp/lily-cuda-pkg and runs from there. Logs and results go to $OUT (default ./cuda-out). Needs python3
# with numpy, safetensors, tokenizers, jinja2, nanobind and pytest (the GPU machine's image has them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cuda-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LILY_CACHE_DIR=${LILY_CACHE_DIR:-/tmp/lily-cache}
STAGES=${*:-build tests}
B=/tmp/lily-cuda-build PKG=/tmp/lily-cuda-pkg
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }

# The full-size synthetic checkpoints the later stages load are written in the background (numpy only, no
# extension needed) while the extension builds and the earlier stages run.
write_ckpt() {  # folder, MTP layers
  [ -e "$1/config.json" ] && return 0
  PYTHONPATH=src python3 -c "from lily import bench; bench.synthetic_checkpoint('full', '$1', progress=False, mtp_layers=$2)" \
    > "$OUT/ckpt-$(basename "$1").log" 2>&1 &
}
if has bench || has quickbench || has trace || has ab || has ncu || has continue; then write_ckpt /tmp/lily-full-q4 0; fi
if has mtp-full; then write_ckpt /tmp/lily-full-mtp 1; fi

if has build || [ ! -e "$PKG/lily" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
  cat "$OUT/gpu.txt"
  t0=$(date +%s)
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=${LILY_BUILD_TYPE:-RelWithDebInfo} -DLILY_CUDA=ON -Dnanobind_DIR="$(python3 -m nanobind --cmake_dir)" \
    -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/build.log" 2>&1 \
    && cmake --build "$B" -j "$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r src/lily "$PKG/" && cp "$B"/_core*.so "$PKG/lily/"
  echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$PKG
python3 -c "import lily.engine as e; print(e.backends()['cuda'])"

if has tests; then
  # Parallel processes: most of the time is NVRTC compiling each test shape's modules (one core each).
  python3 -m pytest -q -rs --durations=20 -p no:cacheprovider -n 8 --timeout 300 ${TEST_PATHS:-tests/cuda} ${PYTEST_ARGS:-} \
    ${TEST_K:+-k "$TEST_K"} \
    2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/cuda/test_cuda_backend.py -k "logits_match_cpu and mlx4 or f16_within and mlx4 or decode_graphs" > "$OUT/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -5 "$OUT/sanitize-$tool.log"
  done
fi
if has delta; then  # the DeltaNet op per form (benchmarks/bench_cuda_delta.py)
  python3 benchmarks/bench_cuda_delta.py --rows "${DELTA_ROWS:-4096,16384}" --json "$OUT/delta.json" 2>&1 | tee "$OUT/delta.log"
fi
if has quickbench; then  # QB_OPTIONS: backend-options JSONs (';'-separated), run in turn QB_ROUNDS times (an A/B)
  wait
  IFS=';' read -ra qb_options <<< "${QB_OPTIONS:-"{}"}"
  for round in $(seq "${QB_ROUNDS:-1}"); do
    for i in "${!qb_options[@]}"; do
      echo "== quickbench round $round, backend options ${qb_options[$i]}" | tee -a "$OUT/bench.log"
      python3 benchmarks/bench_cuda.py --cache /tmp/lily-full-q4 --prefill 512,4K --decode 256,4K --repeats 3 \
        --decode-tokens 48 --backend-options "${qb_options[$i]}" --json "$OUT/bench-$i-$round.json" 2>&1 | tee -a "$OUT/bench.log"
    done
  done
fi
if has prefix; then  # issue 13 item 7: warm vs new-only time to first token on lily-tiny, 8K shared prefix
  python3 benchmarks/bench_prefix_cache.py --backend cuda --prefix-tokens 8192 --turns 10 --repeats 3 \
    --keep-sessions 2 --json "$OUT/prefix.json" 2>&1 | tee "$OUT/prefix.log"
fi
if has continue; then  # a continued conversation's first token: the pending token folded into the prefill or not
  python3 benchmarks/bench_continue.py --backend cuda --context 8192 --pairs 20 2>&1 | tee "$OUT/continue.log"
  wait
  python3 benchmarks/bench_continue.py --backend cuda --model /tmp/lily-full-q4 --context 4096 --pairs 10 2>&1 \
    | tee -a "$OUT/continue.log"
fi
if has mtp; then  # issue 14: MTP on lily-tiny, the verify through the prefill path and the decode kernels (default)
  python3 -m pytest -q -rs -p no:cacheprovider tests/cuda/test_mtp_cuda.py 2>&1 | tail -5 | tee "$OUT/mtp-tests.log"
  for form in prefill decode; do
    opts='{"mtp_verify_decode": false}'; [ $form = decode ] && opts='{}'
    LILY_CACHE_DIR=/tmp/lily-cache-mtp-$form python3 benchmarks/bench_mtp.py --backend cuda --repeats 3 \
      --backend-options "$opts" --json "$OUT/mtp-$form.json" 2>&1 | tee "$OUT/mtp-$form.log"
  done
fi
if has trace; then  # issue 11: where a decode step's wall time goes (CUPTI), with and without the Python handoff
  wait
  python3 benchmarks/trace_cuda.py --cache /tmp/lily-full-q4 --prompt 512 --context "${TRACE_CONTEXT:-4096}" --decode-tokens 32 \
    --decode-paths generator,core --json "$OUT/trace.json" 2>&1 | tee "$OUT/trace.log"
fi
if has ab; then  # decode backend options A/B'd in one process, interleaved (benchmarks/ab_decode.py)
  wait
  IFS=';' read -ra ab_options <<< "${AB_OPTIONS:-"{}"}"
  python3 benchmarks/ab_decode.py --cache /tmp/lily-full-q4 --options "${ab_options[@]}" --contexts "${AB_CONTEXTS:-4K}" \
    --rounds "${AB_ROUNDS:-5}" ${AB_PREFILL:+--prefill "$AB_PREFILL"} ${AB_PREFILL_SESSION:+--prefill-session "$AB_PREFILL_SESSION"} \
    --json "$OUT/ab.json" 2>&1 | tee "$OUT/ab.log"
fi
if has ncu; then  # issue 11: why the decode kernels named run below the copy rate (graphs off, one kernel at a time)
  wait
  ncu --clock-control none --import-source yes --kernel-name "regex:${NCU_KERNELS:-moe_(gate_up|down)_decode}" \
    --launch-skip "${NCU_SKIP:-60}" --launch-count "${NCU_COUNT:-2}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \
    --print-details all --page details python3 benchmarks/profile_cuda_step.py --cache /tmp/lily-full-q4 \
    --mark "$OUT/ncu-mark.json" > "$OUT/ncu.txt" 2>&1
  echo "ncu: exit $?"
  grep -v "^==PROF==\|^  *-* *-* *-*$" "$OUT/ncu.txt" | grep -i -A200 "moe_\|gemv" | cut -c1-150 | head -${NCU_LINES:-260}
fi
if has mtp-full; then  # issue 14 item 8: the full-size synthetic model's verify cost (its random head accepts nothing)
  wait
  for form in ${MTP_FULL_FORMS:-decode}; do  # the default (decode kernels); MTP_FULL_FORMS="prefill decode": both
    opts='{"mtp_verify_decode": false}'; [ $form = decode ] && opts='{}'
    LILY_CACHE_DIR=/tmp/lily-cache-mtp-full-$form python3 benchmarks/bench_mtp.py --synthetic full \
      --cache /tmp/lily-full-mtp --backend cuda ${MTP_FULL_ARGS:---prompts 2 --tokens 48 --repeats 1} --backend-options "$opts" \
      --json "$OUT/mtp-full-$form.json" 2>&1 | tee "$OUT/mtp-full-$form.log"
  done
fi
if has bench; then
  wait
  python3 benchmarks/bench_cuda.py --cache /tmp/lily-full-q4 ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
    | tee "$OUT/bench.log"
fi
exit $rc
