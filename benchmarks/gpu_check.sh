#!/usr/bin/env bash
# Every GPU check in one command, at most 8 minutes on an H200 (a deadline cuts the last stages short):
#   1. tests/test_fastpath.py (its CUDA-graph tests) and tests/test_gpu_path.py, on the GPU machine;
#   2. benchmarks/bench.py on the H200 configuration of docs/design.md (Qwen2.5-0.5B shape, random weights, bf16,
#      64 prompts x 8 completions, prompt 128 + 256 new tokens, beta 0.04, the default micro-batch): v = 1 beside
#      transformers' model.generate on the same shapes and stock TRL's GRPOTrainer step, v = 4, and v = 1 on the
#      plain sampler (the reference loop);
#   3. the memory levers (full, gradient checkpointing, LoRA) on the Qwen2.5-1.5B shape;
#   4. one table: per configuration seconds per step, sampling tokens/s (ours and model.generate's), peak memory,
#      sampler_mismatch, TRL's step and the ratio.
# A stage that fails or runs out of time is reported and the next one runs; the exit status is 1 if any failed.
# Everything is logged to ${OUT:-/tmp}/gpu_check.log, each bench's JSON to ${OUT:-/tmp}/gpu_check_*.json.
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine, from the repository root or anywhere
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh   # the same stages on a CPU, tiny model and sizes (under 5 min)
#   PYTHON=.venv/bin/python ...                     # another interpreter (default python3)
#
# The GPU machine has Python 3.12, torch, transformers, peft, accelerate, pandas and pyarrow, but not trl, datasets,
# dill, multiprocess or xxhash, and no internet: their wheels go in .whl/ (an ignored folder, carried along), made
# here with
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 trl datasets dill multiprocess xxhash
# Each is installed on its own; one that fails is reported and skipped. Without an importable trl the TRL
# comparison is skipped, with a message.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.." || exit 2 # the repository root: benchmarks/ is one level down
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  mkdir -p /tmp/site
  for wheel in .whl/*.whl; do
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$wheel" >/dev/null 2>&1 ||
      echo "== could not install $wheel: skipped"
  done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
  MODE="tiny, cpu"
  SIZES=(--model tiny --device cpu --dtype float32 --prompts-per-step 4 --group-size 4 --prompt-len 16 --max-new-tokens 8
         --beta 0.04 --warmup 1 --threads 1)
  export OMP_NUM_THREADS=1  # a shared CPU: more threads than free cores only wait on each other
  FIT_SIZES=("${SIZES[@]}")
  BUDGET=280
else
  MODE="qwen2.5-0.5b-random, cuda, bf16"
  # Expected about 40 s of tests, then steps of about 2 s (ours), 18 s (TRL's) and 7 s (the plain sampler).
  SIZES=(--model qwen2.5-0.5b-random --device cuda --dtype bfloat16 --prompts-per-step 64 --group-size 8 --prompt-len 128
         --max-new-tokens 256 --beta 0.04 --warmup 1)
  FIT_SIZES=(--model qwen2.5-1.5b-random --device cuda --dtype bfloat16 --prompts-per-step 16 --group-size 8 --prompt-len 128
             --max-new-tokens 256 --beta 0.04 --micro-batch 32 --warmup 1)
  BUDGET=470
fi
DEADLINE=$((SECONDS + BUDGET))

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
echo "== mode: $MODE; all stages within ${BUDGET}s"

STATUS=() FAILED=0
stage() {  # stage NAME LIMIT COMMAND...: run it within min(LIMIT, the time left), whatever happened before
  local name=$1 limit=$2 rc=0 t0=$SECONDS left=$((DEADLINE - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    STATUS+=("$name: not run (out of time)") FAILED=1
    echo "== $name: not run, ${left}s left"
    return
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" || rc=$?
  local how=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then how="timed out"; elif [ "$rc" != 0 ]; then how="failed (exit $rc)"; fi
  [ "$how" = ok ] || FAILED=1
  STATUS+=("$name: $how, $((SECONDS - t0)) s")
  echo "== $name: $how in $((SECONDS - t0)) s"
}
bench() {  # bench NAME LIMIT ARGS...: bench.py; its last JSON line (even if cut short) saved as NAME.json
  local name=$1 limit=$2 base="$OUTDIR/gpu_check_$1"
  shift 2
  rm -f "$base.json"
  stage "$name" "$limit" bash -c 'set -o pipefail; "$0" -m benchmarks.bench "${@:2}" | tee "$1.out"' "$PY" "$base" "$@"
  grep "^{" "$base.out" 2>/dev/null | tail -n 1 >"$base.json"
}

stage tests 90 "$PY" -m pytest tests/test_fastpath.py tests/test_gpu_path.py -q -rs -p no:cacheprovider
bench v1 150 "${SIZES[@]}" --offpolicy-steps 1 --steps 2 --vs-generate "${TRL[@]}"
# One warm-up cycle, then one timed cycle of 4 steps: its refresh samples the 4 batches in one go.
bench v4 60 "${SIZES[@]}" --offpolicy-steps 4 --steps 4
bench v1-plain-sampling 60 "${SIZES[@]}" --offpolicy-steps 1 --steps 1 --sampling plain
for fit in plain ckpt lora; do  # one process each, as `--fit` runs them
  bench "fit-$fit" 40 "${FIT_SIZES[@]}" --steps 1 $("$PY" -c "import sys; sys.path.insert(0, '.')
from benchmarks.compare import FITS; print(' '.join(FITS['$fit']))")
done

echo
echo "== summary ($MODE); log: $LOG"
printf '%s\n' "${STATUS[@]}"
"$PY" - "$OUTDIR" <<'EOF'
import json, sys
from pathlib import Path
print(f"{'run':<19}{'step s':>8}{'sample':>8}{'update':>8}{'samp tok/s':>11}{'gen tok/s':>10}{'peak GB':>8}"
      f"{'mismatch':>10}{'TRL s':>8}{'ours/TRL':>9}  path")
for name in ("v1", "v4", "v1-plain-sampling", "fit-plain", "fit-ckpt", "fit-lora"):
    path = Path(sys.argv[1]) / f"gpu_check_{name}.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"{name:<19}{'no result':>8}")
        continue
    ph, gen, mm = r["phases"], r.get("generate_tokens_per_s"), r.get("sampler_mismatch")
    gen = f"{gen:>10.0f}" if gen else f"{'-':>10}"
    mm = f"{mm:>10.2e}" if mm is not None else f"{'-':>10}"
    trl = f"{r['trl_step_s']:>8.2f}{r['ratio_vs_trl']:>9.3f}" if "trl_step_s" in r else f"{'-':>8}{'-':>9}"
    print(f"{name:<19}{r['step_s_mean']:>8.3f}{ph['sample']:>8.3f}{ph['update']:>8.3f}{r['sample_tokens_per_s']:>11.0f}"
          f"{gen}{r['peak_mem_gb']:>8.1f}{mm}{trl}  {r['sampling_path']}, micro-batch {r['micro_batch']}")
EOF
exit "$FAILED"
