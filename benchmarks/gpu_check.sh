#!/usr/bin/env bash
# Every GPU check in one command, as the GPU machine is (Python, torch, transformers; no pytest, no internet):
#   1. checks: benchmarks/gpu_checks.py, a plain script (no pytest): the static-cache sampler runs as a CUDA graph on
#      Qwen2 and Llama shapes and under LoRA, greedy tokens equal the plain loop's, after an optimizer step the graph
#      samples from the new weights, the chunked log-prob equals the textbook one in value and gradient (float32 and
#      bf16 autocast), a tiny run's sampler_mismatch below its dtype's bound (float32 and bfloat16);
#   2. benchmarks/bench.py on the H200 configuration of docs/design.md (Qwen2.5-0.5B shape, random weights, bf16,
#      64 prompts x 8 completions, prompt 128 + 256 new tokens, beta 0.04, the default micro-batch and sample rows):
#      v = 1 with --token-timings (ms per token of the graph's replay, the sampling chain and its textbook form, a
#      whole static-cache call, the plain loop and model.generate; the LM head's log-probs against the textbook's)
#      and stock TRL's GRPOTrainer step where trl is importable; v = 4 as the defaults run it (log alpha recomputed);
#      v = 4 with log alpha from the sampler (the refresh period sampled in one call either way, where memory allows);
#      lag4: --lag 4 (the first step samples 5 batches, each later step one);
#      cap40: v = 1 at the same shape with the process capped at 40 GiB (bench --memory-cap-gb 40:
#      torch.cuda.set_per_process_memory_fraction(40 GiB / total)), the default micro-batch and sample rows sized
#      from the cap (engine.policy.available_bytes): it must take a step, and reports its seconds and peak reserved;
#      on the CPU (GPU_CHECK_TINY=1) the cap is a no-op that says so;
#   3. the memory levers (full, gradient checkpointing, LoRA) on the Qwen2.5-1.5B shape;
#   4. one table, one line a stage (its result and seconds; a bench's seconds per step, sampling tokens/s, ours and
#      model.generate's, peak memory allocated and reserved, sampler_mismatch, TRL's step and the ratio, the
#      micro-batch used; the checks' counts), v = 4's steps against v = 1's, the ms per token of v = 1, then one JSON
#      line with every stage, every check and their figures.
# A stage that fails or runs out of time is reported and the next one runs; the exit status is 1 if any failed. A
# stage that needs an extra that is not installed (peft for fit-lora, trl for the TRL comparison) says
# "== <stage>: skipped: <extra> not installed" and does not fail the check.
# Everything is logged to ${OUT:-/tmp}/gpu_check.log, each stage's JSON to ${OUT:-/tmp}/gpu_check_*.json.
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine, from the repository root or anywhere
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh   # the same stages on a CPU, tiny model and sizes (about 1 min)
#   PYTHON=.venv/bin/python ...                     # another interpreter (default python3)
#
# Time on the GPU: a deadline of 290 s (under 5 minutes) for every stage together; each stage also has its own
# limit. Each stage has an expected time, written below from byte and FLOP counts (python -m benchmarks.estimate:
# a step at the benchmark's shape on an H100, 2.75 s at v = 1 and 3.02 s at v = 4 once K/V is not repeated; a
# process's start, the model built and the graph captured, ~15 s): a stage whose expected time no longer fits the
# time left is skipped with one line ("== NAME: skipped: expected Ns, Ms left"), never a failure. In the order a
# first device run must learn them, expected / limit:
#   checks      30 s / 90 s   the small models' checks (the issue's estimate)
#   v1          35 s / 130 s  15 s + 3 steps x 2.75 s + ~10 s of token timings (4 x 32 tokens of each sampling loop, the head)
#   cap40       25 s / 75 s   15 s + 2 steps x ~3.2 s (micro-batch 16, not 32) + margin
#   v4          45 s / 30 s + 16 v1 steps   15 s + 2 refresh periods x 4 steps x 3.0 s + margin
#   lag4        35 s / 30 s + 16 v1 steps   15 s + the first step (5 batches: ~8 s) + 3 steps x 2.9 s + margin
#   fit-lora    25 s / 50 s   the 1.5B shape, 16 x 8 rows, one step: ~20 s to start, ~5 s the step
# 195 s in all, of the 290; then, where time is left: v4-sampler 40 s, fit-plain 20 s, fit-ckpt 22 s.
# Where trl is importable its comparison (3 TRL steps, ~60 s) runs inside v1: v1's limit and the deadline grow by
# 90 s then (380 s), stated in the first lines the script prints.
#
# The GPU machine has Python 3.12, torch, transformers (and, not guaranteed, peft and accelerate), but not trl,
# datasets, dill, multiprocess or xxhash, and no internet. TRL's wheels can travel in .whl/ (an ignored folder:
# it travels only when the device tool's `carry` names `.whl/`), made here with
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 trl datasets dill multiprocess xxhash
# Each is installed on its own into /tmp/site; one that fails is reported and skipped.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.." || exit 2 # the repository root: benchmarks/ is one level down
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
STAGES="$OUTDIR/gpu_check_stages.tsv"  # name, result, seconds: one line a stage, for the table at the end
: >"$LOG"
: >"$STAGES"
exec > >(tee -a "$LOG") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  mkdir -p /tmp/site
  for wheel in .whl/*.whl; do
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$wheel" >/dev/null 2>&1 ||
      echo "== could not install $wheel: skipped"
  done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

"$PY" - <<'EOF'
import importlib, platform, torch, transformers
def version(name):
    try:
        return importlib.import_module(name).__version__
    except Exception as e:
        return f"not importable ({type(e).__name__})"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
print(f"== python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {version('peft')}, trl {version('trl')}, {gpu}")
EOF
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
TRL=() PEFT=1 TRL_S=0
if has trl; then TRL=(--vs-trl) TRL_S=90; fi
has peft || PEFT=0

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
  MODE="tiny, cpu"
  DEVICE=cpu
  SIZES=(--model tiny --device cpu --dtype float32 --prompts-per-step 4 --group-size 4 --prompt-len 16 --max-new-tokens 8
         --beta 0.04 --warmup 1 --threads 1)
  export OMP_NUM_THREADS=1  # a shared CPU: more threads than free cores only wait on each other
  FIT_SIZES=("${SIZES[@]}")
  BUDGET=$((280 + TRL_S))
else
  MODE="qwen2.5-0.5b-random, cuda, bf16"
  DEVICE=cuda
  SIZES=(--model qwen2.5-0.5b-random --device cuda --dtype bfloat16 --prompts-per-step 64 --group-size 8 --prompt-len 128
         --max-new-tokens 256 --beta 0.04 --warmup 1)
  # The fit stages measure memory (a step's peak): one step each, no warm-up.
  FIT_SIZES=(--model qwen2.5-1.5b-random --device cuda --dtype bfloat16 --prompts-per-step 16 --group-size 8 --prompt-len 128
             --max-new-tokens 256 --beta 0.04 --micro-batch 32 --warmup 0)
  BUDGET=$((290 + TRL_S))
fi
DEADLINE=$((SECONDS + BUDGET))
echo "== mode: $MODE; all stages within ${BUDGET}s$([ "$TRL_S" = 0 ] || echo " (${TRL_S}s of it for TRL's comparison)")"

FAILED=0
note() {  # note NAME RESULT SECONDS: one row of the final table
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$STAGES"
}
skip() {  # skip NAME EXTRA: a stage whose extra is not installed; not a failure
  echo "== $1: skipped: $2 not installed"
  note "$1" "skipped: $2 not installed" 0
}
stage() {  # stage NAME LIMIT COMMAND...: run it within min(LIMIT, the time left), whatever happened before; SHOWN:
           # the command as printed (default: COMMAND); EXPECT: its expected seconds, skipped if the time left is less
  local name=$1 limit=$2 rc=0 t0=$SECONDS left=$((DEADLINE - SECONDS)) expect=${EXPECT:-10}
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$left" -lt "$expect" ] || [ "$limit" -lt 10 ]; then  # EXPECT: its expected seconds (see the top)
    echo "== $name: skipped: expected ${expect}s, ${left}s left"
    note "$name" "skipped: out of time" 0
    return
  fi
  echo "== $name (limit ${limit}s): ${SHOWN:-$*}"
  timeout --kill-after=5 "$limit" "$@" || rc=$?
  local how=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then how="timed out"; elif [ "$rc" != 0 ]; then how="failed (exit $rc)"; fi
  [ "$how" = ok ] || FAILED=1
  echo "== $name: $how in $((SECONDS - t0)) s"
  note "$name" "$how" "$((SECONDS - t0))"
}
run_saving_json() {  # NAME LIMIT MODULE ARGS...: a stage running `python -m MODULE`; its last JSON line -> NAME.json
  local name=$1 limit=$2 base="$OUTDIR/gpu_check_$1"
  shift 2
  rm -f "$base.json" "$base.out"
  SHOWN="$PY -m $*" stage "$name" "$limit" bash -c 'set -o pipefail; "$0" -m "${@:2}" | tee "$1.out"' "$PY" "$base" "$@"
  grep "^{" "$base.out" 2>/dev/null | tail -n 1 >"$base.json"
}
bench() {  # bench NAME LIMIT ARGS...: bench.py; its last JSON line (even if cut short) saved as NAME.json
  local name=$1 limit=$2
  shift 2
  run_saving_json "$name" "$limit" benchmarks.bench "$@"
}

# Expected seconds a stage (the top's table); on the CPU (tiny) every stage takes 5-15 s.
if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then exp() { echo 15; }; else exp() {
  case $1 in checks) echo 30 ;; v1) echo $((35 + TRL_S)) ;; cap40) echo 25 ;; v4) echo 45 ;; lag4) echo 35 ;;
    fit-lora) echo 25 ;; v4-sampler) echo 40 ;; fit-plain) echo 20 ;; fit-ckpt) echo 22 ;; esac
}; fi
EXPECT=$(exp checks) run_saving_json checks 90 benchmarks.gpu_checks --device "$DEVICE"
[ "${#TRL[@]}" = 0 ] && skip vs-trl trl  # the TRL comparison runs inside v1 where trl is importable
EXPECT=$(exp v1) bench v1 $((130 + TRL_S)) "${SIZES[@]}" --offpolicy-steps 1 --steps 2 --token-timings "${TRL[@]}"
# The benchmark's shape in 40 GiB (the goal's memory): one warm-up step, one timed; its peak reserved is the figure.
EXPECT=$(exp cap40) bench cap40 75 "${SIZES[@]}" --offpolicy-steps 1 --warmup 1 --steps 1 --memory-cap-gb 40
# One warm-up refresh period, then one timed period of 4 steps: its refresh samples the 4 batches. Its limit:
# the process's start (30 s: the model, the graph's capture) and 8 steps at twice v1's measured mean step.
V4_LIMIT=$("$PY" -c "import json, math, sys
try:
    step = json.load(open(sys.argv[1]))['step_s_mean']
except Exception:
    step = 10.0  # no v1 figure: a GPU step of about 3 s estimated, 10 s assumed
print(max(60, math.ceil(30 + 8 * 2 * step)))" "$OUTDIR/gpu_check_v1.json")
EXPECT=$(exp v4) bench v4 "$V4_LIMIT" "${SIZES[@]}" --offpolicy-steps 4 --steps 4
# --lag 4: the warm-up step samples 5 batches, each timed step one (its step k + 4), log alpha recomputed.
EXPECT=$(exp lag4) bench lag4 "$V4_LIMIT" "${SIZES[@]}" --lag 4 --steps 3
fit() {  # fit NAME: one process, as `--fit` runs it
  if [ "$1" = lora ] && [ "$PEFT" = 0 ]; then skip fit-lora peft; return; fi
  EXPECT=$(exp "fit-$1") bench "fit-$1" 50 "${FIT_SIZES[@]}" --steps 1 $("$PY" -c "import sys; sys.path.insert(0, '.')
from benchmarks.compare import FITS; print(' '.join(FITS['$1']))")
}
fit lora
# Where time is left.
EXPECT=$(exp v4-sampler) bench v4-sampler "$V4_LIMIT" "${SIZES[@]}" --offpolicy-steps 4 --steps 4 --alpha-logp-from sampler
fit plain
fit ckpt

echo
echo "== summary ($MODE); log: $LOG"
"$PY" - "$OUTDIR" "$MODE" "$BUDGET" "$SECONDS" <<'EOF'
import json, sys
from pathlib import Path

out, mode, budget, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def load(name):
    try:
        return json.loads((out / f"gpu_check_{name}.json").read_text())
    except (OSError, ValueError):
        return None


stages = []
for line in (out / "gpu_check_stages.tsv").read_text().splitlines():
    name, result, seconds = line.split("\t")
    stages.append(dict(name=name, result=result, seconds=int(seconds), figures=load(name)))
print(f"{'stage':<19}{'result':<26}{'s':>5}{'step s':>8}{'sample':>8}{'update':>8}{'samp tok/s':>11}{'gen tok/s':>10}"
      f"{'peak GB':>8}{'resv GB':>8}{'mismatch':>10}{'TRL s':>8}{'ours/TRL':>9}  path")
for s in stages:
    head, r = f"{s['name']:<19}{s['result']:<26}{s['seconds']:>5}", s["figures"]
    if s["name"] == "checks":
        print(head + (f"  {r['ok']} ok, {r['failed']} failed ({', '.join(r['failed_checks']) or '-'}), "
                      f"{r['skipped']} skipped; {r['device']}" if r else "  no result"))
        continue
    if r is None:
        print(head + ("  no result" if not s["result"].startswith("skipped") else ""))
        continue
    ph, mm = r["phases"], r.get("sampler_mismatch")
    gen = r.get("generate_tokens_per_s")
    if gen is None and "token_ms" in r:  # model.generate's ms per decode step of N rows: tokens per second
        gen = r["prompts"] * r["group"] * 1e3 / r["token_ms"]["generate"]
    gen = f"{gen:>10.0f}" if gen else f"{'-':>10}"
    mm = f"{mm:>10.2e}" if mm is not None else f"{'-':>10}"
    trl = f"{r['trl_step_s']:>8.2f}{r['ratio_vs_trl']:>9.3f}" if "trl_step_s" in r else f"{'-':>8}{'-':>9}"
    print(f"{head}{r['step_s_mean']:>8.3f}{ph['sample']:>8.3f}{ph['update']:>8.3f}{r['sample_tokens_per_s']:>11.0f}"
          f"{gen}{r['peak_mem_gb']:>8.1f}{r.get('peak_reserved_gb', float('nan')):>8.1f}{mm}{trl}  "
          f"{r['sampling_path']}, micro-batch {r['micro_batch']}, "
          f"{r.get('sample_calls_per_refresh', 0):g} sampling call(s) a refresh")
figures = {s["name"]: s["figures"] for s in stages if s["figures"]}
if "cap40" in figures:
    r = figures["cap40"]
    cap = (f"capped at {r['memory_cap_gb']:g} GiB (per-process fraction {r['memory_fraction']:.4f})"
           if r.get("memory_cap_gb") else "the cap a no-op on the CPU")
    print(f"cap40, {cap}: step {r['step_s_mean']:.3f} s, peak {r['peak_mem_gb']:.2f} GB allocated, "
          f"{r['peak_reserved_gb']:.2f} GB reserved ({r['memory_measure']}), micro-batch {r['micro_batch']}")
if "v1" in figures:
    for name in ("v4", "lag4", "v4-sampler"):
        if name in figures:
            ratio = figures[name]["step_s_mean"] / figures["v1"]["step_s_mean"]
            print(f"{name}: {ratio:.3f} x v1's mean step (sampling {figures[name]['phases']['sample']:.3f} s a step "
                  f"against {figures['v1']['phases']['sample']:.3f} s)")
    ms = figures["v1"].get("token_ms")
    if ms:
        rows = figures["v1"]["prompts"] * figures["v1"]["group"]
        print(f"v1, ms per decode step of {rows} rows: " + ", ".join(
            f"{k} {ms[k]:.3f}" for k in ("decode_step", "chain", "chain_textbook", "static_call", "plain_loop", "generate")
        ))
        print(f"v1, ms per 1,000 scored tokens of the head's log-probs (forward and backward): chunked {ms['head']:.2f}, "
              f"textbook {ms['head_textbook']:.2f}")
failed = [s["name"] for s in stages if s["result"] != "ok" and not s["result"].startswith("skipped")]
out_of_time = [s["name"] for s in stages if s["result"] == "skipped: out of time"]
if out_of_time:
    print(f"skipped for time (expected more than was left): {', '.join(out_of_time)}")
print(f"{len(stages) - len(failed)} of {len(stages)} stages ok or skipped, {len(failed)} failed; {wall} s of {budget} s")
print(json.dumps(dict(mode=mode, budget_s=budget, wall_s=wall, failed=failed, stages=stages)))
EOF
exit "$FAILED"
