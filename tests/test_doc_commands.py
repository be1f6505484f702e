"""Every command README.md and docs/*.md show runs as written (issue 55 point 9).

The commands are read from the Markdown at collection (fenced blocks and inline `code`), one case each, named
file:line. Each is looked up in HOW, which says what the test does with it:

- Run: the command as written, by bash from the repository root (HOME a temporary folder, OMP_NUM_THREADS=1,
  the hub offline), with flags appended at the end where it takes them so that it runs at a tiny size (argparse
  keeps the last value): a change of signature fails here, not in a reader's hands.
- Parse: a command that needs what this machine lacks (a GPU, a hub download, several processes, a file of the
  user's, or minutes), with its reason: its argv, as bash expands it, goes through its module's own parser (or
  `bash -n`, or Python's compile for a snippet), so a renamed flag still fails.
- Listed: not a command of its own (a pattern, a synopsis, the test suite itself), with its reason.

A command in the docs that HOW does not list fails its case: a new command is run or listed, never dropped.
"""

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import ROOT, SHARED, needs

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A part of a shell line that runs this project's code (or launches it: torchrun, accelerate, verl's main).
PROJECT = re.compile(
    r"(^|\s)(python3?\s+(-m\s+(studies|benchmarks|integrations|engine|pytest|verl)\b|train\.py|tests/|-c\s|-\s)"
    r"|torchrun\s|accelerate\s+launch\s|bash\s+benchmarks/)"
)


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    text: str  # as written (a fenced command keeps its continuation lines)
    env: str = ""  # the block's assignments before it (SMOL=..., common="..."), for bash to expand

    @property
    def key(self) -> str:
        return norm(self.text)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def norm(text: str) -> str:
    """The command on one line: continuations joined, a heredoc's body and a snippet's later lines left out."""
    line = text.replace("\\\n", " ").split("\n")[0]
    return " ".join(re.sub(r"\s+#\s.*$", "", line).split())  # a trailing comment is not part of the key


def complete(text: str) -> bool:
    """Whether a fenced command's lines so far make one shell command (no continuation, quote or loop open)."""
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return not (re.match(r"\s*(for|while)\s", text) and not re.search(r"\bdone\s*$", text.split("#")[0].strip()))


def block_commands(lines: list[str], first: int) -> list[tuple[int, str]]:
    """A fenced block's shell commands as (line, text): continuations, open quotes, heredocs and loops joined."""
    out, buf, start, heredoc = [], [], 0, None
    for n, line in enumerate(lines, first):
        if not buf:
            start = n
        buf.append(line)
        if heredoc:
            if line.strip() == heredoc:
                out.append((start, "\n".join(buf)))
                buf, heredoc = [], None
            continue
        m = re.search(r"<<-?\s*'?(\w+)'?", line)
        if m and len(buf) == 1:
            heredoc = m.group(1)
            continue
        if complete("\n".join(buf)):
            out.append((start, "\n".join(buf)))
            buf = []
    return out


def split_and(text: str) -> list[str]:
    """`a && b` as its parts (a `&&` inside quotes stays)."""
    parts, cur = [], ""
    for piece in text.split(" && "):
        cur = f"{cur} && {piece}" if cur else piece
        if complete(cur):
            parts.append(cur)
            cur = ""
    return parts + ([cur] if cur else [])


def is_assignment(text: str) -> bool:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return False
    return len(words) == 1 and re.match(r"^[A-Za-z_]\w*=", words[0]) is not None


def doc_commands(path: Path) -> list[Command]:
    name = "README.md" if path.name == "README.md" else f"docs/{path.name}"
    lines = path.read_text().split("\n")
    found, prose, i, env = [], list(lines), 0, []  # env: the page's assignments so far (SMOL=... in one block
    while i < len(lines):
        fence = re.match(r"^(\s*)```", lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while not re.match(r"^\s*```", lines[j]):
            j += 1
        body = [x[len(fence.group(1)) :] for x in lines[i + 1 : j]]
        for n, text in block_commands(body, i + 2):
            if is_assignment(text):
                env.append(text)
            for part in split_and(text):
                if PROJECT.search(part.split("\n")[0] if "<<" in part.split("\n")[0] else part):
                    found.append(Command(name, n, part, "\n".join(env)))
        prose[i : j + 1] = [""] * (j + 1 - i)
        i = j + 1
    text = "\n".join(prose)
    for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text):
        code = " ".join(m.group(1).split())
        if PROJECT.match(code) or (re.match(r"^([A-Z_]+=\S+\s+)+", code) and PROJECT.search(code)):
            found.append(Command(name, text.count("\n", 0, m.start()) + 1, code))
    return sorted(found, key=lambda c: c.line)


COMMANDS = [c for p in DOCS for c in doc_commands(p)]


# --- what the test does with each ----------------------------------------------------------------------------

TINY_TRAIN = "--steps 2 --prompts-per-step 2 --group-size 2 --eval-size 4 --eval-every 0 --no-progress --out {out}"
TINY_BENCH = "--steps 1 --warmup 0 --prompts-per-step 2 --group-size 2 --prompt-len 4 --max-new-tokens 4 --threads 1"
TINY_TRL = (
    "--max_steps 1 --eval-size 4 --per_device_train_batch_size 4 --num_generations 2 --max_completion_length 4 "
    "--output_dir {out} --report_to none --disable_tqdm True"
)


@dataclass(frozen=True)
class Run:
    """Run as written, `extra` appended (formatted with out = a fresh folder, tmp = the session's, data)."""

    extra: str = ""
    why_extra: str = ""  # why the appended flags (or the substitutions) are what they are
    sub: tuple = ()  # (written, replaced) pairs: placeholders, or a loop's list cut to one value
    after: str | None = None  # the key of a command whose run this one reads (run first)
    cwd: str | None = None  # a folder under the session's tmp (a tutorial's working folder)
    pre: str = ""  # a shell line run first (formatted as extra): what the command expects to find
    status: int = 0
    expect: str = ""  # a string its output must hold
    extras: tuple = ()  # (module, extra) pairs it needs: a skip that names the extra, as conftest's needs


@dataclass(frozen=True)
class Parse:
    """Not run, for `why`: its argv goes through the module's parser (`how`: train, bench, trl, help, bash, python,
    import)."""

    why: str
    how: str
    extras: tuple = ()


@dataclass(frozen=True)
class Listed:
    """Not a command of its own."""

    why: str


BENCH_MANY = (
    "bench.py runs one process per v and log-alpha way: 20-30 s even at 2 x 2, past this file's budget; "
    "tests/test_bench.py runs bench.py end to end and docs/benchmarks.md:3 runs here"
)
NEEDS_GGUF = "needs the SmolLM2 GGUF file under ~/.cache (docs/real-model.md fetches it) and minutes of CPU"
NEEDS_HUB = "needs a hub download (a model or data set), and a GPU's hours"
NEEDS_GPU = "needs a GPU (the script's stages are sized for an H100/H200)"
TRL = (("trl", "trl"),)
YOUR_OWN_TASK = (
    "run as written, in order, with the page's other blocks (the data and my_reward.py they write), by "
    "tests/test_your_own_task.py::test_the_your_own_task_page_runs_as_written"
)

HOW: dict[str, object] = {
    # --- README.md ---
    "python train.py --offpolicy-steps 4": Run(TINY_TRAIN, "the quick-start job at 2 steps of 2 x 2"),
    "python -m pytest -q": Listed("the test suite itself, which holds this file"),
    "python -m studies.clip_example --offpolicy-steps 4 --inner-steps 4 --steps 40": Run(
        TINY_TRAIN.replace("--steps 2", "--steps 4"), "train.py's flags: 4 steps, one refresh period", expect="clip"
    ),
    "python -m studies.very_stale": Run(
        "--table-only --out-dir {out}",
        "its grid is hundreds of runs: --table-only rebuilds the table from results/very_stale.csv",
        pre="cp results/very_stale.csv {out}/",
        expect="very_stale_table.md",
    ),
    "python train.py --help": Run(expect="--offpolicy-steps"),
    # --- docs/benchmarks.md ---
    "python -m benchmarks.bench": Run(TINY_BENCH, "bench.py's own flags: one timed step of 2 x 2"),
    "bash benchmarks/gpu_check.sh": Parse(NEEDS_GPU, "bash"),
    "python -m benchmarks.bench --model tiny --prompts-per-step 8 --group-size 8 --max-new-tokens 16 --beta 0.04 "
    "--vs-trl --device cpu --threads 1 --prompt-len 32": Parse(
        "TRL's trainer beside ours: 10 s at 2 x 2, past this file's budget (tests/test_bench.py runs --vs-trl)", "bench"
    ),
    "python -m benchmarks.bench --model ~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "--prompts-per-step 8 --group-size 4 --prompt-len 48 --max-new-tokens 32 --beta 0.04 --vs-trl --device cpu "
    "--threads 2 --steps 3 --warmup 1": Parse(NEEDS_GGUF, "bench"),
    "python -m benchmarks.bench --model ~/.cache/offpolicy-grpo/smollm2 --prompts-per-step 8 --group-size 4 "
    "--prompt-len 48 --max-new-tokens 96 --offpolicy-steps 1 4 --alpha-logp-from recompute sampler --steps 4 "
    "--warmup 0 --device cpu --threads 2": Parse(NEEDS_GGUF, "bench"),
    "python -m benchmarks.bench --model ~/.cache/offpolicy-grpo/smollm2 --prompts-per-step 8 --group-size 4 "
    "--prompt-len 48 --max-new-tokens 96 --offpolicy-steps 1 4 --alpha-logp-from sampler --steps 8 --warmup 0 "
    "--device cpu --threads 2": Parse(NEEDS_GGUF, "bench"),
    "python -m benchmarks.bench --model tiny --prompts-per-step 16 --group-size 8 --prompt-len 8 --max-new-tokens 8 "
    "--offpolicy-steps 1 4 --alpha-logp-from recompute sampler --steps 16 --warmup 4 --device cpu --threads 2": Parse(
        BENCH_MANY, "bench"
    ),
    "OMP_NUM_THREADS=1 python train.py --model ~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "--task wordproblems --steps 4 --prompts-per-step 4 --group-size 4 --max-new-tokens 32 --no-mask-zero-std "
    "--eval-size 4 --eval-every 0 --offpolicy-steps 4": Parse(NEEDS_GGUF, "train"),
    "python -m benchmarks.bench --model tiny --prompts-per-step 64 --group-size 8 --prompt-len 16 --max-new-tokens 24 "
    "--offpolicy-steps 1 4 --steps 4 --warmup 4 --sample-rows 512": Parse(BENCH_MANY, "bench"),
    "python -m benchmarks.bench --model tiny --prompts-per-step 64 --group-size 8 --prompt-len 16 --max-new-tokens 24 "
    "--offpolicy-steps 1 4 --steps 4 --warmup 4": Parse(BENCH_MANY, "bench"),
    "python -m benchmarks.bench --model tiny --prompts-per-step 64 --group-size 8 --prompt-len 16 --max-new-tokens 24 "
    "--offpolicy-steps 1 4 --alpha-logp-from recompute sampler --steps 4 --warmup 4": Parse(BENCH_MANY, "bench"),
    'python -c "import torch; g = torch.Generator().manual_seed(0); l = (torch.randn(64, 49152, generator=g) * '
    "3).bfloat16()": Run(expect="mean"),
    "python -m benchmarks.bench --model ~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "--prompts-per-step 8 --group-size 4 --prompt-len 48 --max-new-tokens 32 --steps 1 --warmup 0 --device cpu "
    "--threads 2 --token-timings": Parse(NEEDS_GGUF, "bench"),
    'python -c "import sys, torch; import engine.chunked_logprobs as c; c.add_product = c.chunk_logp = None': Parse(
        "runs in a checkout of 0c29afe (the block's first line makes it), where those names do not exist yet",
        "python",
    ),
    "python train.py --offpolicy-steps 4 --steps 30 --eval-size 16": Parse(
        "README.md:13's run with --steps and --eval-size, the two flags a tiny run overrides: it runs there", "train"
    ),
    "python train.py --compile --sampling fast --steps 3 --eval-size 8 --no-progress": Parse(
        "torch.compile takes ~30 s of compiling on this CPU (tests/test_compile.py runs its paths)", "train"
    ),
    "PYTHONPATH=. python - <<'EOF'": Run(expect="| 80 GiB | 2048 |"),
    "python - <<'PY'": Parse(
        "7 s, past this file's budget: its census functions are tests/test_decode_gqa.py's, which the suite runs",
        "python",
    ),
    'python -m pytest -q -s tests/test_memory_plan.py -k fit_a_40 | grep "predicted peak"': Parse(
        "tests of the suite, which runs them: here -k must still select one, and the code print the line grepped",
        "pytest",
    ),
    "python -m benchmarks.estimate": Run(expect="| H100 |"),
    "GPU_CHECK_TINY=1 OUT=$(mktemp -d) bash benchmarks/gpu_check.sh": Parse(
        "25-130 s on this CPU, more than this file's budget; CI's gpu-check stage runs it", "bash"
    ),
    "python -m benchmarks.gpu_checks": Run(
        "--device cpu --only greedy", "every check takes minutes on a CPU: the greedy checks alone", expect="0 failed"
    ),
    "for cap in avx512 avx2 default; do for seed in 0 1 2 3 4 5 6 7 8 9; do": Run(
        why_extra="30 runs: the loops cut to one kernel family and one seed",
        sub=(("avx512 avx2 default", "default"), ("0 1 2 3 4 5 6 7 8 9", "0")),
        expect="0 failed",
    ),
    "python -m benchmarks.gpu_checks --device cpu --only chunked --defect value+0.1": Parse(
        "5 s; the loop above runs these checks, and tests/test_gpu_checks.py pins both defects", "source"
    ),
    "python -m benchmarks.gpu_checks --device cpu --only chunked --defect gradx1.4": Parse(
        "5 s; the loop above runs these checks, and tests/test_gpu_checks.py pins both defects", "source"
    ),
    "GPU_CHECK_TINY=1 PYTHON=.venv-gpucheck/bin/python bash benchmarks/gpu_check.sh": Parse(
        "a second venv (.venv-gpucheck) and 25 s; CI's gpu-check stage runs it", "bash"
    ),
    "GPU_CHECK_TINY=1 OMP_NUM_THREADS=1 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh": Parse(
        "127 s on this CPU, more than this file's budget", "bash"
    ),
    # --- docs/design.md ---
    'python -c "import config; from engine.queue_fit import queue_batch_bytes; from problems.prompts import '
    "load_problems, run_rewards": Run(expect="bytes a batch"),
    "python -m studies.clip_example --offpolicy-steps 4 --inner-steps 4 --steps 40 --out runs/clip-example": Parse(
        "README.md:91's run, with --out: it runs there", "train"
    ),
    "python train.py --lag 32 --m2-threshold 0.04 --opsm-delta 0.5 --steps 100 --eval-every 0 --eval-size 100 "
    "--out runs/masks": Run(
        "--steps 34 --prompts-per-step 16 --group-size 4 --eval-size 4 --no-progress --out {tmp}/masks/runs/masks",
        "the next line reads steps 32 updates stale, and every step's masks: 34 steps, 16 x 4 so that no step lacks a "
        "group with signal (a skipped step logs no mask), in a folder of its own",
    ),
    "python -c \"import json; r = [json.loads(l) for l in open('runs/masks/metrics.jsonl')]; s = [x for x in r if "
    "x['staleness'] == 32]": Run(
        after="python train.py --lag 32 --m2-threshold 0.04 --opsm-delta 0.5 --steps 100 --eval-every 0 "
        "--eval-size 100 --out runs/masks",
        cwd="masks",
    ),
    "python -m engine.tiny --rebuild": Parse("rewrites the shipped tiny_policy/ (a minute of warm-up)", "source"),
    "python -m integrations.trl_grpo": Parse("docs/trl.md:18 runs it, with --offpolicy-steps 4", "trl", TRL),
    "torchrun --nproc_per_node 2 -m integrations.trl_grpo": Parse(
        "two processes (tests/test_trl_grpo.py runs them)", "trl", TRL
    ),
    "python -m studies.<name>": Listed("a pattern: each study's command is written out where its results are"),
    "python tests/trl_upstream.py": Listed("the script named in prose; docs/trl.md writes its command"),
    # --- docs/experiments.md ---
    "python train.py $common --offpolicy-steps 1 --no-mask-zero-std --out runs/exp1-on-policy": Parse(
        NEEDS_HUB, "train"
    ),
    "python train.py $common --offpolicy-steps 1 --out runs/exp1-on-policy-masked": Parse(NEEDS_HUB, "train"),
    "python train.py $common --offpolicy-steps 10 --out runs/exp1-v10": Parse(NEEDS_HUB, "train"),
    "python train.py --model $SMOL --task gsm8k --data-files gsm8k/train.jsonl --eval-files gsm8k/test.jsonl "
    "--eval-size 8 --eval-samples 2 --eval-every 0 --steps 2 --offpolicy-steps 2 --prompts-per-step 2 --group-size 4 "
    "--max-new-tokens 128 --lora-rank 16 --lr 1e-4 --out runs/exp1-cpu": Parse(
        NEEDS_GGUF + ", and GSM8K's rows as the user's JSONL", "train"
    ),
    "python train.py $common --offpolicy-steps 1 --out runs/exp2-on-policy": Parse(NEEDS_HUB, "train"),
    "python train.py $common --offpolicy-steps 10 --out runs/exp2-v10": Parse(NEEDS_HUB, "train"),
    "python train.py --model $SMOL --task math --data-files math500/test.jsonl --temperature 0.6 --top-p 0.95 "
    "--eval-samples 4 --eval-size 4 --eval-every 0 --steps 2 --prompts-per-step 2 --group-size 4 --max-new-tokens "
    "1024 --lora-rank 16 --gradient-checkpointing --lr 1e-4 --out runs/exp2-cpu": Parse(
        NEEDS_GGUF + " (58 of them)", "train"
    ),
    "python train.py --model $SMOL --task math --data-files math500/test.jsonl --temperature 0.6 --top-p 0.95 "
    "--no-mask-zero-std --no-eval-start --eval-size 1 --eval-every 0 --steps 1 --prompts-per-step 2 --group-size 4 "
    "--max-new-tokens 1024 --lora-rank 16 --gradient-checkpointing --lr 1e-4 --out runs/exp2-cpu-update": Parse(
        NEEDS_GGUF + " (20 of them)", "train"
    ),
    # --- docs/failure-modes.md ---
    "python train.py --resume --out <run>": Parse(
        "<run> is the user's run folder; a run to resume would cost this file 9 s more, and tests/test_run_folder.py "
        "and test_reward_failure_resume.py resume runs through this command line (flags only: no run is there)",
        "train-flags",
    ),
    "python -c \"import sys; sys.path[:0]=['.','tests']; from hostile import verifier_timing; "
    'print(verifier_timing(20000))"': Run(
        sub=(("verifier_timing(20000)", "verifier_timing(200)"),), why_extra="200 hostile inputs, not 20,000"
    ),
    # --- docs/math-verifier.md ---
    "python -m studies.verifier_probe --data DATA": Run(
        "--limit 2 --out {out}/probe.md",
        "DATA: ../shared/data; the first 2 golds of each set",
        sub=(("DATA", "{data}"),),
        extras=(("math_verify", "math"),),
    ),
    "python -m studies.verifier_probe --limit 20 --data DATA": Run(
        "--limit 2 --out {out}/probe.md",
        "DATA: ../shared/data; 2 golds",
        sub=(("DATA", "{data}"),),
        extras=(("math_verify", "math"),),
    ),
    # --- docs/real-model.md ---
    "python train.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --offpolicy-steps 4 --beta 0.04 "
    "--max-new-tokens 512 --micro-batch 32 --eval-size 200": Parse(NEEDS_HUB, "train"),
    "python train.py --model ~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --task wordproblems "
    "--steps 12 --prompts-per-step 8 --group-size 8 --max-new-tokens 48 --temperature 0.7 --lr 2e-5 --micro-batch 16 "
    "--eval-size 200 --eval-every 4": Parse(NEEDS_GGUF, "train"),
    "MALLOC_MMAP_THRESHOLD_=131072 python -m benchmarks.bench --model "
    "~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompts-per-step 8 --group-size 4 --prompt-len "
    "48 --max-new-tokens 96 --fit plain ckpt bf16 lora lora+ckpt --device cpu --threads 2 --steps 2 --warmup 1": Parse(
        NEEDS_GGUF, "bench"
    ),
    # --- docs/trl.md ---
    "python -m integrations.trl_grpo --offpolicy-steps 4 --output_dir runs/trl": Run(
        TINY_TRL, "TRL's flags: one step of 2 x 2", extras=TRL
    ),
    "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m integrations.trl_grpo --offpolicy-steps 4 --max_steps 8 "
    "--output_dir runs/trl2": Parse("two processes (tests/test_trl_grpo.py runs them)", "trl", TRL),
    "accelerate launch --num_processes 8 -m integrations.trl_grpo --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k "
    "--use_vllm --vllm_mode colocate --offpolicy-steps 4 --beta 0.04 --per_device_train_batch_size 16 "
    "--num_generations 8 --max_completion_length 512 --learning_rate 1e-6 --max_steps 500 --output_dir "
    "runs/qwen-trl": Parse("8 GPUs, vLLM and a hub model", "trl", TRL),
    "python -m benchmarks.bench --trl-subclass --prompts-per-step 8 --group-size 8": Parse(
        "three TRL trainers, 27 s at 2 x 2: past this file's budget (tests/test_trl_grpo.py runs the subclass)",
        "bench",
        TRL,
    ),
    "python tests/trl_upstream.py --trl-repo DIR --piece 1/8": Parse(
        "DIR is a git clone of huggingface/trl, and a piece of its tests takes minutes", "help"
    ),
    "python tests/trl_upstream.py --trl-repo DIR [--ref main] [--piece I/N | -k EXPR] [--stock] [--failed-in REPORT] "
    "[--out DIR]": Listed("a synopsis ([...] optional); docs/trl.md:292 is the command"),
    "python -m benchmarks.bench --trl-subclass --model ~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "--prompts-per-step 4 --group-size 4 --prompt-len 16 --max-new-tokens 8 --threads 1 --steps 4 --warmup 0 "
    "--device cpu": Parse(NEEDS_GGUF, "bench"),
    # --- docs/verl.md ---
    "VERL_USE_EXTERNAL_MODULES=integrations.verl_grpo PYTHONPATH=$PWD python3 -m verl.trainer.main_ppo …": Parse(
        "verl with vLLM, Ray and a GPU; the module it names is imported", "import", (("verl", "verl"),)
    ),
    "python3 -m verl.experimental.one_step_off_policy.main_ppo": Listed("verl's own entry point: no code of ours"),
    # --- docs/your-own-task.md ---
    'python -c "import json, random': Listed(YOUR_OWN_TASK),
    "python train.py --dataset problems.jsonl --reward my_reward.py:exact --reward my_reward.py:length "
    "--reward-weights 1 0.5 --eval-size 100 --max-new-tokens 8 --steps 20 --log-completions 2 --out runs/my-task "
    "--no-progress": Listed(YOUR_OWN_TASK),
    "python train.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset openai/gsm8k --dataset-config main "
    '--prompt-field question --answer-field answer --eval-split test --eval-size 200 --instruction "Solve the '
    'problem. Put the final answer on the last line after ####." --log-completions 4 --out runs/gsm8k-smol': Parse(
        NEEDS_HUB, "train"
    ),
    "python train.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset HuggingFaceH4/MATH-500 --split test "
    "--prompt-field problem --answer-field answer --reward math-symbolic --eval-size 100 --max-new-tokens 1024 "
    '--instruction "Please reason step by step, and put your final answer within \\boxed{}." --out '
    "runs/math-smol": Parse(NEEDS_HUB, "train"),
}


def how(cmd: Command):
    if cmd.key in HOW:
        return HOW[cmd.key]
    return next((v for k, v in HOW.items() if k.endswith("…") and cmd.key.startswith(k[:-1].rstrip())), None)


# --- running ----------------------------------------------------------------------------------------------------


@dataclass
class Session:
    tmp: Path
    done: dict = field(default_factory=dict)  # a command's key: its run (a command the docs show twice runs once)
    n: int = 0

    def env(self) -> dict:
        path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
        return {
            "PATH": path,
            "HOME": str(self.tmp / "home"),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "MPLBACKEND": "Agg",
        }

    def fresh(self, name: str) -> Path:
        self.n += 1
        path = self.tmp / f"{self.n:02d}-{name}"
        path.mkdir(parents=True)
        return path


@pytest.fixture(scope="session")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("doc-commands"))
    (s.tmp / "home").mkdir()
    (s.tmp / "masks").mkdir()
    return s


def script_of(cmd: Command, action: Run, session: Session, out: Path) -> str:
    values = dict(out=out, tmp=session.tmp, data=SHARED)
    text = cmd.text
    for written, replaced in action.sub:
        assert written in text, f"{cmd.id}: {written!r} is no longer in the command"
        text = text.replace(written, replaced.format(**values))
    if action.extra:
        last = re.sub(r"\s+#\s.*$", "", text.split("\n")[-1])  # a trailing comment would swallow the flags
        text = "\n".join([*text.split("\n")[:-1], f"{last} {action.extra.format(**values)}"])
    pre = action.pre.format(**values) + " || exit 99\n" if action.pre else ""
    return f"{pre}{cmd.env}\n{text}" if cmd.env else pre + text


def run(cmd: Command, session: Session) -> subprocess.CompletedProcess:
    if cmd.key in session.done:
        return session.done[cmd.key]
    action = how(cmd)
    if action.after is not None:
        first = next(c for c in COMMANDS if c.key == action.after)
        r = run(first, session)
        assert r.returncode == 0, f"{first.id}, which {cmd.id} reads, failed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    out = session.fresh("out")
    script = script_of(cmd, action, session, out)
    cwd = session.tmp / action.cwd if action.cwd else ROOT
    r = subprocess.run(["bash", "-c", script], cwd=cwd, env=session.env(), capture_output=True, text=True, timeout=300)
    r.args = script
    session.done[cmd.key] = r
    return r


def argv_of(cmd: Command) -> list[str]:
    """The argv bash would pass to the launcher (python, python3, torchrun, accelerate, bash): the shell's own
    splitting, with ~, $VARS of the block and a trailing comment handled as it handles them."""
    launchers = "".join(f"{name}() {{ printf '%s\\0' {name} \"$@\"; }}\n" for name in ("python", "python3", "torchrun"))
    launchers += "accelerate() { printf '%s\\0' accelerate \"$@\"; }\n"
    text = re.sub(r"<([a-z][\w-]*)>", r"\1", cmd.text)  # a placeholder, <run>, as a word: run
    r = subprocess.run(
        ["bash", "-c", f"{launchers}{cmd.env}\n{text}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return r.stdout.split("\0")[:-1]


def module_and_args(argv: list[str]) -> tuple[str, list[str]]:
    """('train.py' or a module or a script, its own arguments) from a launcher's argv."""
    if argv[0] in ("torchrun", "accelerate"):
        i = argv.index("-m")
        return argv[i + 1], argv[i + 2 :]
    rest = argv[1:]
    if rest[0] == "-m":
        return rest[1], rest[2:]
    return rest[0], rest[1:]


def parse_only(cmd: Command, action: Parse) -> None:
    if action.how == "bash":
        script = re.search(r"\bbash\s+(\S+\.sh)\b", cmd.text).group(1)  # not argv_of: $(mktemp -d) would run
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
        return
    if action.how == "python":
        heredoc = re.match(r"[^\n]*<<'(\w+)'[^\n]*\n(.*)\n\1$", cmd.text, re.S)
        code = heredoc.group(2) if heredoc else re.search(r'python -c "(.*)"\s*$', cmd.text, re.S).group(1)
        compile(code, cmd.id, "exec")
        return
    if action.how == "import":
        module = re.search(r"VERL_USE_EXTERNAL_MODULES=(\S+)", cmd.text).group(1)
        __import__(module)
        return
    if action.how == "pytest":
        args = shlex.split(cmd.text.split("|")[0])
        test_file = next(a for a in args if a.endswith(".py"))
        k = args[args.index("-k") + 1]
        assert re.search(rf"def test_\w*{k}", (ROOT / test_file).read_text()), f"-k {k} selects no test of {test_file}"
        grepped = re.search(r'grep "([^"]+)"', cmd.text).group(1)
        assert grepped in (ROOT / "engine" / "memory.py").read_text(), f"nothing prints {grepped!r}"
        return
    target, args = module_and_args(argv_of(cmd))
    if action.how == "train":
        assert target in ("train.py", "studies.clip_example"), target  # the study passes its argv to train.main
        from config import config_from_args, parse_args

        parsed, given = parse_args(args)
        config_from_args(parsed, given)
    elif action.how == "train-flags":
        from config import parse_args

        parse_args(args)
    elif action.how == "bench":
        assert target == "benchmarks.bench", target
        from benchmarks import bench

        bench.build_parser().parse_args(args)
    elif action.how == "trl":
        assert target == "integrations.trl_grpo", target
        from integrations import trl_grpo

        trl_grpo.parse_args([*args, "--use_cpu", "True"])  # else TrainingArguments refuses bf16 without a GPU
    elif action.how == "source":
        # the parser is built inside the script's main or __main__: each flag written is one it adds, each value
        # a name the module defines
        path = ROOT / (target if target.endswith(".py") else target.replace(".", "/") + ".py")
        source = path.read_text()
        for i, a in enumerate(args):
            if a.startswith("-"):
                assert f'"{a}"' in source, f"{cmd.id}: {a} is not a flag of {target}"
            elif args[i - 1] not in ("--device", "--only"):
                assert f'"{a}"' in source, f"{cmd.id}: {a} is not a value {target} names"
    elif action.how == "help":
        # the parser is built inside the script's __main__: --help runs it, and each flag written must be in it
        launcher = [sys.executable, "-m", target] if not target.endswith(".py") else [sys.executable, target]
        r = subprocess.run([*launcher, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        for flag in (a.split("=")[0] for a in args if a.startswith("-")):
            assert flag in r.stdout, f"{cmd.id}: {flag} is not in {target}'s --help"
    else:
        raise AssertionError(action.how)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_doc_command(cmd: Command, session):
    action = how(cmd)
    assert action is not None, (
        f"{cmd.id} shows a command this test neither runs nor lists: add it to HOW in {Path(__file__).name}\n"
        f"{cmd.key!r}"
    )
    if isinstance(action, Listed):
        return
    for module, extra in action.extras:
        needs(module, extra)
    if isinstance(action, Parse):
        parse_only(cmd, action)
        return
    if "{data}" in str(action.sub) and not SHARED.exists():
        pytest.skip(f"{SHARED} not present")
    r = run(cmd, session)
    shown = f"{cmd.id}: bash -c {shlex.quote(r.args)}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert r.returncode == action.status, shown
    assert "Traceback" not in r.stderr or action.status != 0, shown
    assert action.expect in r.stdout + r.stderr, shown


def test_the_docs_show_commands():
    """The extraction finds the commands (a change of the Markdown's shape must not leave nothing to test)."""
    files = {c.file for c in COMMANDS}
    assert {"README.md", "docs/benchmarks.md", "docs/trl.md", "docs/your-own-task.md"} <= files
    assert len(COMMANDS) >= 60, len(COMMANDS)


def test_every_listed_command_is_still_in_the_docs():
    """HOW holds no command the docs no longer show (a stale entry would hide a renamed one)."""
    keys = {c.key for c in COMMANDS}
    stale = [k for k in HOW if k not in keys and not (k.endswith("…") and any(x.startswith(k[:-1]) for x in keys))]
    assert not stale, stale


def test_every_parse_only_command_has_a_reason():
    for key, action in HOW.items():
        if isinstance(action, Parse | Listed):
            assert action.why, key
        if isinstance(action, Run) and (action.extra or action.sub):
            assert action.why_extra, f"{key}: say why these flags (or substitutions)"
