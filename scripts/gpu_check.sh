#!/bin/bash
# The GPU checks on a CUDA host, with random weights in real shapes (no model download):
# tests/gpu, then bench/bench_cuda_graphs.py in the SmolLM2-135M (fp32) and Llama-3.2-1B (bf16) shapes.
#
#   OUT=/tmp/gpu_check TOKENIZER_DIR=<folder with config.json + tokenizer files> bash scripts/gpu_check.sh
#
# Wheels in .whl/ (xgrammar, llguidance, ... for a host without them) are installed under /tmp/site
# first. TOKENIZER_DIR defaults to the cached default model's folder. Logs and JSON go to $OUT.
# Time limits (s): PYTEST_S, BENCH1_S, BENCH2_S, LONG_S; NPROC pytest workers (OMP threads split between them);
# MASK_THREADS: the guided_mask_threads values the SmolLM2-shape benchmark compares (default 1,8).
# The two long tests (10,000 grammar replays, 2,000 hybrid engine steps, each with a GIL-competing
# thread; at Python's 5 ms switch interval they ran at ~17 and ~1 steps/s on an H100) run last, in
# parallel, under LONG_S; their progress goes to $OUT/progress.log (a slow test vs a hung one).
# LONG_FIRST=1 starts them in the background before the other tests (a 16-core host runs both).
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/backend_src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export SPECGUIDE_CACHE_DIR=${SPECGUIDE_CACHE_DIR:-/tmp/gpu_check_cache}
TOK=${TOKENIZER_DIR:-$(python3 -m specguide.models.default_model)}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import torch,transformers,numpy;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__,'numpy',numpy.__version__)"; } 2>&1 | tee "$OUT/env.txt"
python3 scripts/make_random_model.py --shape smollm2-135m --out "$SPECGUIDE_CACHE_DIR/models/smollm2-135m-instruct" --tokenizer "$TOK"
python3 scripts/make_random_model.py --shape llama-3.2-1b --dtype bfloat16 --out /tmp/gpu_check_llama1b --tokenizer "$TOK"
python3 - <<'PY'
from pathlib import Path

import torch
from transformers import AutoConfig

from specguide.models.default_model import prepare_default_model
from specguide.models.llama import ModelConfig
from specguide.speculative.draft_head import DraftHead

for src, dst in ((prepare_default_model(), "/tmp/gpu_check_head135.pt"), ("/tmp/gpu_check_llama1b", "/tmp/gpu_check_head1b.pt")):
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(src))
    torch.manual_seed(0)
    DraftHead(cfg, torch.arange(0, cfg.vocab_size, 3)).save(Path(dst), {"note": "random"})
PY
echo "setup $(( $(date +%s) - T0 )) s"
N=${NPROC:-4}
LONG="_thousand_"
long_tests() {
    GPU_CHECK_PROGRESS="$OUT/progress.log" OMP_NUM_THREADS=$(( $(nproc) / ${1:-2} )) timeout -s INT ${LONG_S:-300} \
        python3 -m pytest tests/gpu -q -rA -n 2 --tb=short -p no:cacheprovider --durations=5 -k "$LONG" >"$OUT/pytest_long.log" 2>&1
    echo "long tests done $(( $(date +%s) - T0 )) s" >>"$OUT/pytest_long.log"
}
[ "${LONG_FIRST:-0}" = 1 ] && { long_tests 4 & LONG_PID=$!; }
OMP_NUM_THREADS=$(( $(nproc) / N )) timeout -s INT ${PYTEST_S:-240} python3 -m pytest tests/gpu -q -rA -n "$N" --tb=short \
    -p no:cacheprovider --timeout 200 --durations=20 -k "not $LONG" 2>&1 | tee "$OUT/pytest.log" \
    | grep -vE "^(PASSED|SKIPPED)" | tail -150
echo "pytest done $(( $(date +%s) - T0 )) s"
bench() {  # name, timeout, args...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 bench/bench_cuda_graphs.py --batches 1,8,32 --max-tokens 64 --drafter hybrid --fixed-k \
        --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
    grep -E '^(graphs=|[|]|NVIDIA|CPU)' "$OUT/$name.log"
    echo "$name: $(grep -c 'step failed' "$OUT/$name.log") failed steps, done at $(( $(date +%s) - T0 )) s"
}
bench bench135 "${BENCH1_S:-150}" --draft-head /tmp/gpu_check_head135.pt --mask-threads "${MASK_THREADS:-1,8}"
bench bench1b "${BENCH2_S:-120}" --draft-head /tmp/gpu_check_head1b.pt --dtype bfloat16 --model-dir /tmp/gpu_check_llama1b
if [ -n "$LONG_PID" ]; then wait "$LONG_PID"; else long_tests 2; fi
grep -vE "^(PASSED|SKIPPED)" "$OUT/pytest_long.log" | tail -60
tail -6 "$OUT/progress.log"
