"""benchmarks/bench.py end to end: a tiny CPU run as a subprocess, its last line a JSON object."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
# v=2 and beta > 0, two timed steps: one stale step (behaviour pass) and one refresh step
# (load_state_dict), so every phase has work in it.
TINY = [
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--prompt-len",
    "6",
    "--max-new-tokens",
    "4",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--beta",
    "0.04",
    "--offpolicy-steps",
    "2",
    "--threads",
    "1",
]


def run_bench(*extra, pythonpath=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", *TINY, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_last_line_is_json_with_positive_timings():
    lines = run_bench()
    res = json.loads(lines[-1])
    for key in ("step_s", "tokens_per_s", "peak_mem_gb"):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert set(res["phases"]) == {"sample", "score", "logprob", "update"}
    assert all(v > 0 for v in res["phases"].values()), res["phases"]
    # Two timed steps: each median is a mean, so the phases add up to (a little under) the step.
    assert 0.5 * res["step_s"] <= sum(res["phases"].values()) <= 1.01 * res["step_s"]
    assert res["tokens_per_s"] == 2 * 2 * 4 / res["step_s"]  # N * T completion tokens per step
    assert res["sampling_path"] == "plain" and res["micro_batch"] == 4
    assert res["sample_calls_per_refresh"] == 1  # on a CPU the period's v = 2 batches are sampled in one call
    assert any(line.startswith("update") for line in lines)  # the table came first
    # On a CPU the peak "reserved" is the peak resident set, as the allocated one, and the row says so.
    assert res["peak_reserved_gb"] == res["peak_mem_gb"] and res["memory_measure"].startswith("cpu: ")


def test_a_memory_cap_on_the_cpu_is_a_no_op_that_says_so():
    lines = run_bench("--memory-cap-gb", "40", "--offpolicy-steps", "1", "--steps", "1", "--warmup", "0")
    assert sum(line.startswith("memory cap:") and "no-op on the CPU" in line for line in lines) == 1, lines
    res = json.loads(lines[-1])
    assert res["step_s"] > 0 and res["memory_cap_gb"] is None and res["memory_fraction"] is None


def test_token_timings_report_every_part_beside_its_textbook():
    res = json.loads(run_bench("--token-timings")[-1])
    ms = res["token_ms"]
    assert set(ms) == {
        "chain",
        "chain_textbook",
        "decode_step",
        "static_call",
        "plain_loop",
        "generate",
        "head",
        "head_textbook",
    }
    assert all(0 < v < 1e4 for v in ms.values()), ms


def test_vs_trl_without_trl_says_so_in_one_line(tmp_path):
    # A `trl` package that cannot be imported stands in for a machine without TRL.
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise ImportError('no trl here')\n")
    lines = run_bench("--vs-trl", pythonpath=tmp_path)
    assert sum("TRL is not installed" in line for line in lines) == 1
    res = json.loads(lines[-1])
    assert res["step_s"] > 0 and "trl_step_s" not in res
