#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one place, for a session that is lent one.
#
#   bash experiments/gpu_check.sh tests   # GPU tests, and the trainer on the GPU (bf16, graphs)
#   bash experiments/gpu_check.sh bench   # GPU rows of the benchmarks (JSON + tables)
#   bash experiments/gpu_check.sh all     # both, in that order (about 5 minutes on an H200)
#
# Runs with the machine's own python3 and torch (no venv, no streamlit). Logs and JSON go
# to experiments/results/gpu (or $RES); with $OUT set (the device tool's folder, which
# takes back 8 files at most) they go to a scratch folder packed into $OUT/gpu_check.tgz.
# Ends with gpu_check.json: the tests' outcome lines and the trainer runs' final figures.
# Each step has its own time limit, so a slow step cannot eat the others' time.
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
    timeout "$limit" "$@" > "$RES/$log" 2>&1
    local code=$?
    echo "$log: exit $code" | tee -a "$RES/steps.txt"
    [ $code -eq 0 ] || rc=1
}

tests() {
    # the GPU-marked tests (CUDA graph vs eager ratio, export from a CUDA run), the bf16
    # and checkpoint tests, which then run with CUDA present, and DDP (gloo, on the CPU)
    step 120 gpu_tests.log $PY -m pytest -q -rs -p no:cacheprovider tests/test_train.py \
        tests/test_export.py -k "gpu or cuda or graph or bf16 or resume or ddp_truncation"
    # the Triton kernels compiled and run on the GPU, against the same float64 references
    # (the bench smoke tests run the kernels' benchmarks compiled, eager and graphed)
    TRITON_INTERPRET=0 step 150 gpu_kernels.log $PY -m pytest -q -rs -p no:cacheprovider \
        tests/test_kernels.py tests/test_kernels_ttm.py
    # the trainer end to end on the GPU (auto precision = bf16): CUDA graphs on and off,
    # and with the fused Triton kernels (opt-in: COMERA_KERNELS=1). (NCCL DDP needs two
    # GPUs: the lent machines have one, so DDP is tested on gloo only.)
    for variant in graph eager kernels; do
        local graph=true kernels=0
        [ $variant = eager ] && graph=false
        [ $variant = kernels ] && kernels=1
        rm -rf /tmp/gpu_run
        COMERA_KERNELS=$kernels step 90 "train_$variant.log" $PY -m comera_engine.cli train \
            experiments/configs/digits_tt_mlp.toml --set train.device='"cuda"' \
            --set train.cuda_graph=$graph --run-dir /tmp/gpu_run --no-progress
        grep '"type": "metrics"' /tmp/gpu_run/metrics.jsonl 2>/dev/null | tail -n 1 \
            > "$RES/train_$variant.last.jsonl"
    done
    [ -f experiments/results/cuda_graph_step_ratio.json ] &&
        cp experiments/results/cuda_graph_step_ratio.json "$RES/"
}

bench() {
    # the fused kernels against the PyTorch paths they replace, eager and in a CUDA graph
    step 90 bench_kernels.log $PY experiments/bench_kernels.py --out "$RES" --rounds 5
    step 60 bench_kernels_ttm.log $PY experiments/bench_kernels_ttm.py --out "$RES" --rounds 5
    # a training step of the paper's transformer, CoMERA vs dense, kernels off and on
    step 120 bench_train_step.log $PY experiments/bench_train_step.py --presets small paper \
        --batches 128 --min-seconds 1 --out "$RES/bench_train_step_cuda.json"
    COMERA_KERNELS=1 step 90 bench_train_step_kernels.log $PY experiments/bench_train_step.py \
        --presets paper --batches 128 --min-seconds 1 \
        --out "$RES/bench_train_step_cuda_kernels.json"
    # one TT layer and one TT embedding against nn.Linear / nn.Embedding
    step 90 bench_tt_linear.log $PY experiments/bench_tt_linear.py --device cuda --quick \
        --rounds 5 --out "$RES"
    step 60 bench_tt_embedding.log $PY experiments/bench_tt_embedding.py --device cuda
    cp experiments/results/bench_tt_embedding_cuda.json "$RES/" 2>/dev/null
}

case "${1:-tests}" in
tests) tests ;;
bench) bench ;;
all) tests; bench ;;
*)
    echo "usage: $0 tests|bench|all" >&2
    exit 2
    ;;
esac

$PY - "$RES" <<'EOF'
"""gpu_check.json: what ran, on what, and how it ended."""
import json, re, sys, time
from pathlib import Path

import torch
import triton

res = Path(sys.argv[1])
steps = {}
for line in (res / "steps.txt").read_text().splitlines():
    log, _, code = line.partition(": exit ")
    text = (res / log).read_text(errors="replace") if (res / log).is_file() else ""
    outcome = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", text, re.M)
    steps[log] = {"exit": int(code), "pytest": outcome[-1] if outcome else None}
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
