#!/usr/bin/env bash
# The GPU checks of "fast and lean", in one command (about 6 minutes on an H200, at most 12):
#   1. tests/test_fastpath.py on CUDA: the static-cache + CUDA-graph sampler against the plain one;
#   2. benchmarks/bench.py on the H200 configuration of docs/design.md (Qwen2.5-0.5B shape, random weights, bf16,
#      64 prompts x 8 completions, prompt 128 + 256 new tokens, beta 0.04): v=1 with --vs-trl (TRL's
#      GRPOTrainer in the same process), v=4 with both log-alpha ways (its refresh samples the cycle's 4
#      batches at once), and v=1 on the plain sampler (the reference loop); steps are means over cycles;
#   3. the memory levers (gradient checkpointing, bf16 weights, LoRA, LoRA + checkpointing) on the Qwen2.5-1.5B shape;
#   4. a short table of the results, printed last.
# Everything is logged to ${OUT:-/tmp}/gpu_check.log, each bench's JSON to ${OUT:-/tmp}/gpu_check_*.json.
#
#   bash benchmarks/gpu_check.sh           # on the GPU machine, from the repository root or anywhere
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh   # the same steps on CPU, tiny model and sizes
#   PYTHON=.venv/bin/python ...            # another interpreter (default python3)
#
# The GPU machine has torch and transformers but not trl/datasets: wheels in .whl/ (an ignored folder,
# carried along; the first lines of the log name the machine's Python) are installed first, e.g.
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 trl accelerate datasets dill multiprocess xxhash pyarrow pandas psutil
# (about 60 MB: pyarrow is most of it). Without an importable trl the comparison is skipped, with a message.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."  # the repository root: benchmarks/ is one level down
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
  MODE="tiny, cpu"
  SIZES=(--model tiny --device cpu --dtype float32 --prompts 4 --group 4 --prompt-len 16 --max-new-tokens 8
         --beta 0.04 --micro-batch 8 --warmup 1)
  SIZES+=(--threads 1)  # a shared CPU: more threads than free cores only wait on each other
  export OMP_NUM_THREADS=1  # the tests' thread count too (tests/conftest.py reads it)
  T_TEST=300 T_TRL=300 T_V4=120 T_PLAIN=120 T_FIT=120
  FIT_SIZES=("${SIZES[@]}")
else
  MODE="qwen2.5-0.5b-random, cuda, bf16"
  # --micro-batch 64: 8 forward/backward chunks of 64 sequences, so activations fit with room to spare.
  SIZES=(--model qwen2.5-0.5b-random --device cuda --dtype bfloat16 --prompts 64 --group 8 --prompt-len 128
         --max-new-tokens 256 --beta 0.04 --micro-batch 64 --warmup 1)
  # Limits per step, 500 s in all; expected about 40 + 110 + 2 x 35 + 60 s (a step of ours should take
  # about 1.5-2 s, with the plain sampler about 7 s; TRL's about 18 s, docs/design.md).
  T_TEST=80 T_TRL=190 T_V4=70 T_PLAIN=90 T_FIT=45
  # The memory levers (docs/real-model.md, "Fitting the model") on the Qwen2.5-1.5B shape: one warm-up and one timed step each.
  FIT_SIZES=(--model qwen2.5-1.5b-random --device cuda --dtype bfloat16 --prompts 16 --group 8 --prompt-len 128
             --max-new-tokens 256 --beta 0.04 --micro-batch 32 --warmup 1)
fi

"$PY" - <<'EOF'
import platform, torch, transformers
try:
    import trl; t = trl.__version__
except Exception as e:
    t = f"not importable ({type(e).__name__})"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
print(f"== python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, trl {t}, {gpu}")
EOF
if "$PY" -c "import trl" 2>/dev/null; then TRL=(--vs-trl); else
  TRL=(); echo "== trl is not importable here: the TRL comparison is skipped"; fi
echo "== mode: $MODE"

STATUS=()
step() {  # step NAME TIMEOUT COMMAND...: run it, keep going whatever happens, remember how it ended
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  local how=ok
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && how="timed out"
  [ "$rc" != 0 ] && [ "$how" = ok ] && how="failed (exit $rc)"
  STATUS+=("$name: $how, $((SECONDS - t0)) s")
  echo "== $name: $how in $((SECONDS - t0)) s"
}
bench() {  # bench NAME TIMEOUT ARGS...: bench.py; its last JSON line (even if cut short) saved as NAME.json
  local name=$1 limit=$2 base="$OUTDIR/gpu_check_$1"
  shift 2
  step "$name" "$limit" bash -c 'set -o pipefail; "$0" -m benchmarks.bench "${@:2}" | tee "$1.out"' "$PY" "$base" "$@"
  grep "^{" "$base.out" 2>/dev/null | tail -n 1 > "$base.json" || true
}

step fastpath-tests "$T_TEST" "$PY" -m pytest tests/test_fastpath.py -q -rs
bench v1 "$T_TRL" "${SIZES[@]}" --offpolicy-steps 1 --steps 4 "${TRL[@]}"
# One warm-up cycle, then one timed cycle of 4 steps: its refresh samples the 4 batches in one go.
bench v4 "$T_V4" "${SIZES[@]}" --offpolicy-steps 4 --steps 4
bench v4-sampler "$T_V4" "${SIZES[@]}" --offpolicy-steps 4 --steps 4 --alpha-logp-from sampler
bench v1-plain-sampling "$T_PLAIN" "${SIZES[@]}" --offpolicy-steps 1 --steps 2 --sampling plain
for fit in plain ckpt bf16 lora lora+ckpt; do  # one process each, as `--fit` runs them
  bench "fit-$fit" "$T_FIT" "${FIT_SIZES[@]}" --steps 1 $("$PY" -c "import sys; sys.path.insert(0, '.')
from benchmarks.compare import FITS; print(' '.join(FITS['$fit']))")
done

echo
echo "== summary ($MODE); log: $LOG"
printf '%s\n' "${STATUS[@]}"
"$PY" - "$OUTDIR" <<'EOF'
import json, sys
from pathlib import Path
print(f"{'run':<19}{'step s':>8}{'sample':>8}{'logprob':>8}{'update':>8}{'tok/s':>8}{'peak GB':>8}{'TRL s':>8}{'ours/TRL':>9}  path")
for name in ("v1", "v4", "v4-sampler", "v1-plain-sampling", *(f"fit-{f}" for f in ("plain", "ckpt", "bf16", "lora", "lora+ckpt"))):
    path = Path(sys.argv[1]) / f"gpu_check_{name}.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"{name:<19}{'no result':>8}")
        continue
    ph = r["phases"]
    trl = f"{r['trl_step_s']:>8.2f}{r['ratio_vs_trl']:>9.3f}" if "trl_step_s" in r else f"{'-':>8}{'-':>9}"
    print(f"{name:<19}{r['step_s_mean']:>8.3f}{ph['sample']:>8.3f}{ph['logprob']:>8.3f}{ph['update']:>8.3f}"
          f"{r['tokens_per_s']:>8.0f}{r['peak_mem_gb']:>8.1f}{trl}  {r['sampling_path']}, update {r.get('update_mem_gb', 0):.1f} GB")
EOF
