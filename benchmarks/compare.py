"""`python -m benchmarks.bench` with several values of --offpolicy-steps or --alpha-logp: each (v, log-alpha way)
runs bench in a process of its own (so each peak memory is its own), one after the other, then one table;
--vs-trl times TRL once, beside v = 1."""

import json
import subprocess
import sys


def compare(args, argv: list[str], root: str, phases: list[str]) -> int:
    """Every (v, log-alpha way) of the flags, each in a process of its own (a clean peak memory), one after
    the other, then one table: step_s_mean and its ratio to v = 1, the phases' means, peak memory."""
    runs = [(1, args.alpha_logp[0])] if 1 in args.offpolicy_steps else []
    runs += [(v, a) for v in args.offpolicy_steps if v > 1 for a in args.alpha_logp]
    rest, skip = [], False
    for a in argv:  # argv without the multi-valued flags and their values
        skip = a in ("--offpolicy-steps", "--alpha-logp") or (skip and not a.startswith("--"))
        rest += [] if skip or a == "--vs-trl" else [a]
    results = []
    for v, way in runs:
        extra = ["--offpolicy-steps", str(v), "--alpha-logp", way] + (["--vs-trl"] if args.vs_trl and v == 1 else [])
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench", *rest, *extra], cwd=root, text=True,
                             capture_output=True)  # fmt: skip
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return out.returncode
        print("\n".join(out.stdout.strip().splitlines()[:-1]), flush=True)  # the run's own table
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r["step_s_mean"] for r in results if r["offpolicy_steps"] == 1), None)
    print(f"\n{'v':>3} {'log alpha':<10}{'step_s_mean':>12}{'vs v=1':>8}" + "".join(f"{p:>9}" for p in phases)
          + f"{'peak GB':>9}")  # fmt: skip
    for r in results:
        ratio = f"{r['step_s_mean'] / base:.3f}" if base else "—"
        cells = "".join(f"{r['phases'][p]:>9.3f}" for p in phases)
        print(f"{r['offpolicy_steps']:>3} {r['alpha_logp']:<10}{r['step_s_mean']:>12.3f}{ratio:>8}{cells}"
              f"{r['peak_mem_gb']:>9.2f}")  # fmt: skip
    print(json.dumps({"runs": results}), flush=True)
    return 0
