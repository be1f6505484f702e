"""`python -m benchmarks.bench` with several values of --offpolicy-steps, --alpha-logp-from or --fit: each (v, log-alpha
way, fit) runs bench in a process of its own (so each peak memory is its own), one after the other, then one table;
--vs-trl times TRL once, beside the first v = 1 row."""

import json
import subprocess
import sys

FITS = {  # --fit: train.py's memory levers (policy.fit_policy), one row each
    "plain": [],
    "ckpt": ["--gradient-checkpointing"],
    "bf16": ["--param-dtype", "bfloat16"],
    "lora": ["--lora-rank", "16"],
    "lora+ckpt": ["--lora-rank", "16", "--gradient-checkpointing"],
}


def fit_name(cfg) -> str:
    """The --fit name of the config's memory levers (or the flags themselves when no name matches)."""
    flags = (["--lora-rank", str(cfg.lora_rank)] if cfg.lora_rank else []) + (
        ["--param-dtype", "bfloat16"] if cfg.param_dtype == "bfloat16" else []
    )
    flags += ["--gradient-checkpointing"] if cfg.gradient_checkpointing else []
    return next((k for k, v in FITS.items() if sorted(v) == sorted(flags)), " ".join(flags))


def compare(args, argv: list[str], root: str, phases: list[str]) -> int:
    """Every (v, log-alpha way) of the flags, each in a process of its own (a clean peak memory), one after
    the other, then one table: step_s_mean and its ratio to v = 1, the phases' means, peak memory (allocated and
    reserved; on a CPU both are the peak resident set)."""
    fits = args.fit or [None]
    runs = [(1, args.alpha_logp_from[0], f) for f in fits] if 1 in args.offpolicy_steps else []
    runs += [(v, a, f) for v in args.offpolicy_steps if v > 1 for a in args.alpha_logp_from for f in fits]
    rest, skip = [], False
    for a in argv:  # argv without the multi-valued flags and their values
        skip = a in ("--offpolicy-steps", "--alpha-logp-from", "--fit") or (skip and not a.startswith("--"))
        rest += [] if skip or a == "--vs-trl" else [a]
    results = []
    for i, (v, way, fit) in enumerate(runs):
        extra = ["--offpolicy-steps", str(v), "--alpha-logp-from", way] + (FITS[fit] if fit else [])
        extra += ["--vs-trl"] if args.vs_trl and i == 0 and v == 1 else []
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", *rest, *extra], cwd=root, text=True, capture_output=True
        )
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return out.returncode
        print("\n".join(out.stdout.strip().splitlines()[:-1]), flush=True)  # the run's own table
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r["step_s_mean"] for r in results if r["offpolicy_steps"] == 1), None)
    print(
        f"\n{'v':>3} {'log alpha':<10}{'fit':<10}{'step_s_mean':>12}{'vs first':>9}"
        + "".join(f"{p:>9}" for p in phases)
        + f"{'peak GB':>9}{'resv GB':>9}{'update GB':>10}"
    )
    for r in results:
        ratio = f"{r['step_s_mean'] / base:.3f}" if base else "—"
        cells = "".join(f"{r['phases'][p]:>9.3f}" for p in phases)
        print(
            f"{r['offpolicy_steps']:>3} {r['alpha_logp_from']:<10}{r['fit']:<10}{r['step_s_mean']:>12.3f}{ratio:>9}"
            f"{cells}{r['peak_mem_gb']:>9.2f}{r['peak_reserved_gb']:>9.2f}{r['update_mem_gb']:>10.2f}"
        )
    print(json.dumps({"runs": results}), flush=True)
    return 0
