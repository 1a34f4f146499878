#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one place, for a session that is lent one.
#
#   bash experiments/gpu_check.sh tests   # GPU tests, and the trainer on the GPU (bf16, graphs)
#   bash experiments/gpu_check.sh bench   # GPU rows of the benchmarks (JSON + tables)
#
# Runs with the machine's own python3 and torch (no venv, no streamlit). Results go to
# $OUT (the device tool's folder) or experiments/results/gpu; logs are tee'd there too.
# Each part is sized to finish well inside a 10-minute command.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${OUT:-experiments/results/gpu}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

$PY - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
EOF

part=${1:-tests}
rc=0
case "$part" in
tests)
    # the GPU-marked tests (CUDA graph vs eager ratio, export from a CUDA run), and the
    # bf16 and checkpoint tests, which then run with CUDA present
    $PY -m pytest -q -rs -p no:cacheprovider tests/test_train.py tests/test_export.py \
        -k "gpu or cuda or graph or bf16 or resume" 2>&1 | tee "$RES/gpu_tests.log" || rc=1
    # the Triton kernels compiled and run on the GPU, against the same float64 references
    TRITON_INTERPRET=0 $PY -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py \
        tests/test_kernels_ttm.py 2>&1 \
        | tee "$RES/gpu_kernels.log" || rc=1
    # the trainer end to end on the GPU (auto precision = bf16, CUDA graphs on), with and
    # without graphs. (NCCL DDP needs two GPUs: one process per GPU; the lent machines
    # have one, so DDP is tested on gloo in CI only.)
    for graph in true false; do
        rm -rf /tmp/gpu_run
        $PY -m comera_engine.cli train experiments/configs/digits_tt_mlp.toml \
            --set train.device='"cuda"' --set train.cuda_graph=$graph --set train.steps=300 \
            --run-dir /tmp/gpu_run --no-progress 2>&1 | tee -a "$RES/gpu_train.log" || rc=1
        tail -n 3 /tmp/gpu_run/metrics.jsonl >> "$RES/gpu_train.log" 2>/dev/null
    done
    # the same run with the fused Triton kernels on (opt-in: COMERA_KERNELS=1)
    rm -rf /tmp/gpu_run
    COMERA_KERNELS=1 $PY -m comera_engine.cli train experiments/configs/digits_tt_mlp.toml \
        --set train.device='"cuda"' --set train.steps=300 --run-dir /tmp/gpu_run \
        --no-progress 2>&1 | tee -a "$RES/gpu_train_kernels.log" || rc=1
    tail -n 3 /tmp/gpu_run/metrics.jsonl >> "$RES/gpu_train_kernels.log" 2>/dev/null
    [ -f experiments/results/cuda_graph_step_ratio.json ] &&
        cp experiments/results/cuda_graph_step_ratio.json "$RES/"
    ;;
bench)
    $PY experiments/bench_tt_linear.py --device cuda --out "$RES" 2>&1 \
        | tee "$RES/bench_tt_linear.log" || rc=1
    $PY experiments/bench_tt_embedding.py --device cuda 2>&1 \
        | tee "$RES/bench_tt_embedding.log" || rc=1
    $PY experiments/bench_train_step.py --no-docs 2>&1 | tee "$RES/bench_train_step.log" || rc=1
    $PY experiments/bench_kernels.py --out "$RES" 2>&1 | tee "$RES/bench_kernels.log" || rc=1
    $PY experiments/bench_kernels_ttm.py --out "$RES" 2>&1 | tee "$RES/bench_kernels_ttm.log" \
        || rc=1
    $PY experiments/kernels_aot.py --out "$RES" 2>&1 | tee "$RES/kernels_aot.log" || rc=1
    cp experiments/results/bench_tt_embedding_cuda.json experiments/results/bench_train_step.json \
        "$RES/" 2>/dev/null
    ;;
*)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
exit $rc
