#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one place, for a session that is lent one.
#
#   bash experiments/gpu_check.sh tune bench        # first thing whenever a GPU is at hand
#   bash experiments/gpu_check.sh tune tests bench  # everything (within 10 minutes)
#   bash experiments/gpu_check.sh tests             # GPU tests, the trainer on the GPU
#   bash experiments/gpu_check.sh compile           # the step under torch.compile (~60 s)
#
# Steps, in the order given, each with its own time limit (so a slow step cannot eat the
# others' time; the limits add up to 72 s for tune, 154 s for tests, 363 s for bench; on an H100 or
# H200 the tuner needs about 60 s, a step-benchmark row about 15 s):
#   tune   the device profile: every path of every TT op of the paper model (batch 32 and
#          128) and the paper-size configs timed in bf16, eager and graphed, the Triton
#          kernels' launch configurations swept, the cost model calibrated
#          (experiments/tune_gpu.py) -> $RES/profiles/<gpu>.json; later steps of the same
#          call plan with it (COMERA_PROFILE_DIR). Commit it as
#          comera_engine/tensor/profiles/<gpu>.json.
#   tests  the GPU-marked tests (CUDA graph vs eager, export from a CUDA run, bf16), the
#          Triton kernels compiled against float64, the trainer on the GPU with and
#          without CUDA graphs
#   bench  the step benchmark (paper transformer, batch 32 and 128, CoMERA on the
#          planner's paths and with the grouped step ops, CUDA graph on and off, dense
#          alike; graphed at batch 32 with the TT linears' halves merged per layer;
#          batch 1 for peak memory, with PyTorch's cuBLAS workspace and with 4 MiB),
#          the kernels launched per layer path and per step, the batch-32 step's kernel
#          time by kind (GEMM, elementwise, optimizer, ...), the
#          TT-linear and TTM-lookup paths with their % of the roofline, one TT layer vs
#          nn.Linear in bf16 in a CUDA graph, alone and in a group of 24 of its shape
#   compile the step under torch.compile (Inductor) on the tiny transformer against eager,
#          the compile's time and recompiles counted (not in `all`: its first step compiles
#          for ~40 s; on an H200 it was slower than eager, results/gpu/*_compile.json)
#
# Runs with the machine's own python3 and torch (no venv, no streamlit). Logs and JSON go
# to experiments/results/gpu (or $RES); with $OUT set (the device tool's folder, which
# takes back 8 files at most) they go to a scratch folder packed into $OUT/gpu_check.tgz.
# Ends with gpu_check.json: the tests' outcome lines and the trainer runs' final figures.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then RES=${RES:-/tmp/gpu_check}; else RES=${RES:-experiments/results/gpu}; fi
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

$PY - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
import triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
      f"CUDA {torch.version.cuda}")
EOF

rc=0
step() {  # step SECONDS LOG COMMAND...: run with a time limit, log to $RES/LOG
    local limit=$1 log=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$RES/$log" 2>&1
    local code=$?
    echo "$log: exit $code" | tee -a "$RES/steps.txt"
    echo "$log: $((SECONDS - t0)) s of $limit" >> "$RES/step_seconds.txt"
    [ $code -eq 0 ] || rc=1
}

tune() {
    # the tuner stops its cases at 70 % of --budget and its kernel sweep at --budget, and
    # writes the profile after every case: a timeout still leaves a valid file
    step 72 tune.log $PY experiments/tune_gpu.py --out "$RES/profiles" --budget 66
    export COMERA_PROFILE_DIR="$RES/profiles"
}

tests() {
    # the GPU-marked tests (CUDA graph vs eager ratio, export from a CUDA run), the bf16
    # and checkpoint tests, which then run with CUDA present, and DDP (gloo, on the CPU)
    step 55 gpu_tests.log $PY -m pytest -q -rs -p no:cacheprovider tests/test_train.py \
        tests/test_export.py tests/test_op_tt_halves_group.py \
        -k "gpu or cuda or graph or bf16 or resume or ddp_truncation"
    # the Triton kernels compiled and run on the GPU, every launch configuration, against
    # the same float64 references (the ahead-of-time compile is a CPU test)
    TRITON_INTERPRET=0 step 63 gpu_kernels.log $PY -m pytest -q -rs -p no:cacheprovider \
        tests/test_kernels.py tests/test_kernels_ttm.py -k "not compile_ahead"
    # the trainer end to end on the GPU (auto precision = bf16), CUDA graphs on and off,
    # planning with the profile of the tune step where it ran. (NCCL DDP needs two GPUs:
    # the lent machines have one, so DDP is tested on gloo only.)
    for variant in graph eager; do
        local graph=true
        [ $variant = eager ] && graph=false
        rm -rf /tmp/gpu_run
        step 18 "train_$variant.log" $PY -m comera_engine.cli train \
            experiments/configs/digits_tt_mlp.toml --set train.device='"cuda"' \
            --set train.cuda_graph=$graph --run-dir /tmp/gpu_run --no-progress
        grep '"type": "metrics"' /tmp/gpu_run/metrics.jsonl 2>/dev/null | tail -n 1 \
            > "$RES/train_$variant.last.jsonl"
        grep '"kind": "paths"' /tmp/gpu_run/metrics.jsonl 2>/dev/null | tail -n 1 \
            > "$RES/train_$variant.paths.jsonl"
    done
    [ -f experiments/results/cuda_graph_step_ratio.json ] &&
        cp experiments/results/cuda_graph_step_ratio.json "$RES/"
}

bench() {
    # a training step of the paper's transformer, CoMERA vs dense: batch 32 (the paper's)
    # and 128, on the planner's paths, graphed and eager; the JSON is written after every
    # run, so a timeout keeps what was measured (the other path choices: --paths
    # reconstructed factorised fused, timed per layer by the tune step's profile;
    # --grouped-step: graphed, with the refresh of all bonds at once and torch's fused
    # AdamW)
    step 140 bench_train_step.log $PY experiments/bench_train_step.py --presets paper \
        --batches 32 128 --paths auto --eager-paths auto --grouped-step \
        --graphs both --steps 10 --min-seconds 0.5 --out "$RES/bench_train_step_cuda.json"
    # the same step, graphed, with every TT linear merging its own halves (TrainStep's
    # grouping off): what the grouping buys
    step 30 bench_train_step_ungrouped.log $PY experiments/bench_train_step.py --presets paper \
        --batches 32 --graphs on --ungrouped --steps 10 --min-seconds 0.3 \
        --out "$RES/bench_train_step_cuda_ungrouped.json"
    # batch 1: peak memory against dense + AdamW, with PyTorch's cuBLAS workspace (32 MiB
    # a stream on Hopper, allocated from the caching allocator: part of the peak) and
    # with 4 MiB (dense and CoMERA alike; experiments/bench_memory.py counts the rest)
    step 60 bench_train_step_batch1.log $PY experiments/bench_train_step.py \
        --presets paper --batches 1 --graphs on --steps 5 --min-seconds 0.1 \
        --cublas-workspace-mb default 4 --out "$RES/bench_train_step_cuda_batch1.json"
    # kernels launched per TT layer path and per training step (and by phase), against
    # the CPU proxy committed in experiments/results/bench_launches_cpu.json
    COMERA_KERNELS=1 step 23 bench_launches.log $PY experiments/bench_launches.py \
        --reps 1 --out "$RES"
    # where the batch-32 step's device time goes, by kernel kind (GEMM, elementwise,
    # optimizer, attention, ...), CoMERA on the paths a graph replays against dense
    step 35 bench_launches_step_b32.log $PY experiments/bench_launches.py --device cuda \
        --step-only --step-batch 32 --reps 2 --graph-paths --out "$RES/step_b32" &&
        mv "$RES/step_b32/bench_launches_cuda.json" "$RES/bench_launches_cuda_step_b32.json"
    # every TT-linear path and the TTM lookup's against the dense layers, % of roofline
    step 15 bench_kernels.log $PY experiments/bench_kernels.py --out "$RES" --rounds 5
    step 15 bench_kernels_ttm.log $PY experiments/bench_kernels_ttm.py --out "$RES" --rounds 5
    # one TT layer on the planner's path against nn.Linear, as the trainer runs it
    step 20 bench_tt_linear.log $PY experiments/bench_tt_linear.py --device cuda --quick \
        --dtype bf16 --graph --tokens 4096 16384 --rounds 5 --out "$RES"
    # ... and 24 layers of each shape on one input, grouped as a training step runs them
    # (times per layer), on the planner's path and reconstructed (W = L·R from the grouped
    # halves, then nn.Linear's GEMMs), side by side
    step 25 bench_tt_linear_group.log $PY experiments/bench_tt_linear.py --device cuda \
        --quick --dtype bf16 --graph --group 24 --tokens 4096 --rounds 5 \
        --paths planner dense --out "$RES"
}

compile() {
    # CoMERA's step with its forward and objective under torch.compile (Inductor) against
    # eager, the compile's time and Dynamo's recompiles counted (the tiny transformer: the
    # paper's compiles for minutes; run that apart, the same command with --presets paper)
    step 90 bench_train_step_compile.log $PY experiments/bench_train_step.py --presets tiny \
        --batches 32 --graphs off --compile default --steps 10 --min-seconds 0.3 \
        --out "$RES/bench_train_step_cuda_compile.json"
}

[ $# -gt 0 ] || set -- tests
for what in "$@"; do
    case "$what" in
    tune) tune ;;
    tests) tests ;;
    bench) bench ;;
    compile) compile ;;
    all) tune; tests; bench ;;
    *)
        echo "usage: $0 [tune] [tests] [bench] [compile] | all" >&2
        exit 2
        ;;
    esac
done

$PY - "$RES" <<'EOF'
"""gpu_check.json: what ran, on what, and how it ended."""
import json, re, sys, time
from pathlib import Path

import torch
import triton

res = Path(sys.argv[1])
steps = {}
seconds = {}
if (res / "step_seconds.txt").is_file():
    for line in (res / "step_seconds.txt").read_text().splitlines():
        log, _, took = line.partition(": ")
        seconds[log] = took
for line in (res / "steps.txt").read_text().splitlines():
    log, _, code = line.partition(": exit ")
    text = (res / log).read_text(errors="replace") if (res / log).is_file() else ""
    outcome = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", text, re.M)
    steps[log] = {"exit": int(code), "pytest": outcome[-1] if outcome else None,
                  "seconds": seconds.get(log)}
train = {}
for path in sorted(res.glob("train_*.last.jsonl")):
    text = path.read_text().strip()
    if text:
        v = json.loads(text)["values"]
        train[path.name.split(".")[0]] = {
            k: v.get(k) for k in ("compression/tensorized", "compression/target", "eval/acc",
                                  "perf/step_time_s", "mem/cuda_max_allocated_mb")}
(res / "gpu_check.json").write_text(json.dumps({
    "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "cuda": torch.version.cuda},
    "time": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": steps, "train": train}, indent=2))
print(json.dumps(steps, indent=1))
EOF
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_check.tgz" -C "$RES" . && echo "packed $OUT/gpu_check.tgz"
fi
exit $rc
