"""Shared fixtures. Everything runs offline on the CPU."""

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

import tiny  # noqa: E402

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


def shared_data(*parts) -> Path:
    """A path under ../shared/data, or skip the test where the folder is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p
