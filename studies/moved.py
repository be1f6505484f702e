"""How far a rerun moved a study's results: the final held-out accuracy of every run present in both CSVs.

    python -m studies.moved results/staleness.csv results/stale-batch/staleness.csv

Runs are matched by correction, v, inner steps, lr and seed; the table gives, per (correction, v, inner, lr),
the mean final accuracy over the seeds both files hold, then the paired difference (new minus old) as
mean ± sample std over those seeds. Only runs made by the two commands that wrote the CSVs enter it.
"""

import statistics
import sys
from pathlib import Path

from studies.runner import mean_sd
from studies.staleness import read_rows, runs_of


def moved_table(old: list[dict], new: list[dict]) -> str:
    """Markdown: per (correction, v, inner, lr) over the common seeds, old and new final accuracy, new - old."""
    a, b = runs_of(old), runs_of(new)
    groups = {}
    for key in sorted(a.keys() & b.keys(), key=lambda k: (k[1], k[2], str(k[0]), k[3], k[4])):
        groups.setdefault(key[:4], []).append(key)
    lines = [
        "| correction | v | inner | lr | seeds | before | after | after − before |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for (c, v, inner, lr), keys in groups.items():
        before = [a[k][-1]["eval_accuracy"] for k in keys]
        after = [b[k][-1]["eval_accuracy"] for k in keys]
        diff = [y - x for x, y in zip(before, after)]
        lines.append(
            f"| {c} | {v} | {inner} | {lr:g} | {len(keys)} | {statistics.fmean(before):.3f} | "
            f"{statistics.fmean(after):.3f} | {mean_sd(diff, signed=True)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m studies.moved OLD.csv NEW.csv", file=sys.stderr)
        return 2
    print(moved_table(read_rows(Path(args[0])), read_rows(Path(args[1]))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
