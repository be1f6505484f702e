"""TRL's own GRPOTrainer tests run against OffPolicyGRPOTrainer, offline: the harness of docs/trl.md, "TRL's own tests".

    python tests/trl_upstream.py --trl-repo /path/to/trl.git [--ref main] [-k EXPR] [--stock] [--out DIR]

1. TRL's tests/test_grpo_trainer.py, testing_utils.py and conftest.py at --ref (`git show`, a bare clone is
   enough) go into a work folder outside this repository (TRL's code is TRL's; nothing of it is committed here);
2. local stand-ins for the hub ids the tests name are built there: tiny random-weight causal LMs and sequence
   classifiers of each architecture transformers has (Qwen2, Qwen3, Llama, Mistral, Gemma2, Cohere2, Qwen3-MoE,
   GPT-OSS, GLM4-MoE) on a 512-id byte-level BPE with the special tokens and chat template of Qwen2's tokenizer
   ($QWEN2_TOKENIZER, a folder or hub id; default Qwen/Qwen2-1.5B-Instruct), and the `zen` dataset (standard and
   conversational prompt-only, 8 train and 2 test prompts). from_pretrained and load_dataset take a folder named
   like the hub id, relative to the working directory, for a local one: pytest runs in the work folder;
3. a conftest.py there swaps `trl.GRPOTrainer` and `trl.GRPOConfig` for OffPolicyGRPOTrainer and a config whose
   defaults are stock TRL's (v = 1 on TRL's own schedule, clip_center="alpha", mask_zero_std=False);
   --stock keeps TRL's own: the control run,
   which tells a failure of ours from one of the stand-ins or of the test file's TRL version;
4. pytest runs there (-k selects; run in pieces on a small machine) with HF_HUB_OFFLINE=1, and report.json holds
   every test's outcome and, for a failure, its error's last line; the counts are printed.
Not stood in (their tests fail for want of a model, in both runs): vision-language models and their datasets,
NemotronH, hub-only remote code; TRL's own skip marks (GPU, vLLM, liger, bitsandbytes, jmespath) stay as they are.
"""

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Qwen2's tokenizer, whose special tokens and chat template the stand-ins take: $QWEN2_TOKENIZER, else a local copy
# beside the checkout where the machine has one (offline), else the hub's.
LOCAL_QWEN2 = ROOT.parent / "shared" / "data" / "qwen2-tokenizer"
TOKENIZER = os.environ.get("QWEN2_TOKENIZER") or (
    str(LOCAL_QWEN2) if LOCAL_QWEN2.is_dir() else "Qwen/Qwen2-1.5B-Instruct"
)
TRL_FILES = ("tests/test_grpo_trainer.py", "tests/testing_utils.py", "tests/conftest.py")
PROMPTS = [
    "The sky is",
    "Beautiful is better than",
    "Explicit is better than",
    "Simple is better than",
    "Complex is better than",
    "Flat is better than",
    "Sparse is better than",
    "Readability",
    "Special cases aren't special enough to",
    "Although practicality beats",
    "Errors should never pass",
    "In the face of ambiguity, refuse the",
    "There should be one obvious way to",
    "Now is better than",
    "If the implementation is hard to explain,",
    "Namespaces are one honking great",
    "A cat sat on the",
    "Water boils at",
    "One plus one is",
]
# Architecture -> extra config fields of its tiny stand-in (every one: 2 layers, hidden 16, 4 heads, 2 KV heads).
CAUSAL = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2", {}),
    "tiny-Qwen3ForCausalLM": ("Qwen3", {"head_dim": 4}),
    "tiny-LlamaForCausalLM-3.2": ("Llama", {}),
    "tiny-MistralForCausalLM-0.2": ("Mistral", {}),
    "tiny-Gemma2ForCausalLM": ("Gemma2", {"head_dim": 4}),
    "tiny-Cohere2ForCausalLM": ("Cohere2", {}),
    "tiny-Qwen3MoeForCausalLM": (
        "Qwen3Moe",
        {"head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "tiny-GptOssForCausalLM": ("GptOss", {"head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "tiny-Glm4MoeForCausalLM": (
        "Glm4Moe",
        {"head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
}
CLASSIFIERS = {
    "tiny-Qwen2ForSequenceClassification-2.5": "Qwen2",
    "tiny-Qwen3ForSequenceClassification": "Qwen3",
    "tiny-LlamaForSequenceClassification-3.2": "Llama",
}
CONFTEST = '''"""Written by tests/trl_upstream.py: TRL's tests see OffPolicyGRPOTrainer under TRL's names."""
import sys
from dataclasses import dataclass

sys.path.insert(0, {root!r})
import importlib  # noqa: E402

import trl  # noqa: E402
from integrations.trl_grpo import OffPolicyGRPOConfig, OffPolicyGRPOTrainer  # noqa: E402


@dataclass
class StockDefaultsConfig(OffPolicyGRPOConfig):
    """OffPolicyGRPOConfig with stock TRL's defaults: v = 1, the PPO clip around 1, equal-reward groups kept."""

    clip_center: str = "alpha"
    mask_zero_std: bool = False


def _not_available(name):
    # a feature probe the test file's TRL has and the installed one dropped (liger, joblib ...): absent
    if name.startswith("is_") and name.endswith("_available"):
        return lambda *a, **k: False
    raise AttributeError(name)


importlib.import_module("trl.import_utils").__getattr__ = _not_available
if not {stock!r}:
    trl.GRPOTrainer, trl.GRPOConfig = OffPolicyGRPOTrainer, StockDefaultsConfig
'''


def tiny_config(arch: str, tok, extra: dict):
    import transformers

    common = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    return getattr(transformers, f"{arch}Config")(**common, **extra)


def small_tokenizer(qwen):
    """A byte-level BPE of 512 ids with Qwen2's special tokens and ChatML template: any text, and 300x fewer
    ids than Qwen2's 151,646 (its 3 s load and 151k-wide heads made each test 10x slower)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(PROMPTS * 4, vocab_size=512, special_tokens=special, show_progress=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special[1:],
        chat_template=qwen.chat_template,
    )


def build_stand_ins(work: Path) -> list[str]:
    """Every stand-in under work/trl-internal-testing/; returns the ones transformers could not build."""
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    hub, failed = work / "trl-internal-testing", []
    tok = small_tokenizer(AutoTokenizer.from_pretrained(TOKENIZER))
    models = {name: (f"{arch}ForCausalLM", arch, extra) for name, (arch, extra) in CAUSAL.items()}
    models |= {
        name: (f"{arch}ForSequenceClassification", arch, {"num_labels": 1}) for name, arch in CLASSIFIERS.items()
    }
    for name, (cls, arch, extra) in models.items():
        torch.manual_seed(0)
        try:
            model = getattr(transformers, cls)(tiny_config(arch, tok, extra))
        except Exception as e:  # an architecture whose config needs more than these fields: no stand-in
            failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        if cls.endswith("ForCausalLM"):
            model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(hub / name)
        tok.save_pretrained(hub / name)
    zen = hub / "zen"
    splits = {"train": PROMPTS[:8], "test": PROMPTS[8:10]}
    configs = []
    for config, as_row in (
        ("standard_prompt_only", lambda p: {"prompt": p}),
        ("conversational_prompt_only", lambda p: {"prompt": [{"role": "user", "content": p}]}),
    ):
        files = []
        for split, prompts in splits.items():
            path = zen / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(as_row(p)) + "\n" for p in prompts))
            files.append(f"  - split: {split}\n    path: {config}/{split}.jsonl\n")
        configs.append(f"- config_name: {config}\n  data_files:\n{''.join(files)}")
    (zen / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n")
    return failed


def prepare(work: Path, trl_repo: str, ref: str, stock: bool) -> list[str]:
    """The work folder: TRL's test files at ref, the stand-ins, our conftest.py and pytest.ini."""
    (work / "tests").mkdir(parents=True, exist_ok=True)
    for name in TRL_FILES:
        text = subprocess.run(
            ["git", "--git-dir", trl_repo, "show", f"{ref}:{name}"], capture_output=True, text=True, check=True
        ).stdout
        (work / name).write_text(text)
    (work / "tests" / "__init__.py").write_text("")
    (work / "conftest.py").write_text(CONFTEST.format(root=str(ROOT), stock=stock))
    (work / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return [] if (work / "trl-internal-testing" / "zen" / "README.md").exists() else build_stand_ins(work)


def outcomes(junit: Path) -> dict[str, dict]:
    """test id -> {"outcome": passed | failed | skipped, "message": the error's last line or the skip reason}."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                text = (child.get("message") or child.text or "").strip().splitlines()
                message = text[-1][:300] if text else ""
        out[name] = {"outcome": outcome, "message": message}
    return out


def piece(work: Path, env: dict, spec: str) -> list[str]:
    """The test ids of piece I of N (--piece I/N), in the file's order."""
    i, n = (int(x) for x in spec.split("/"))
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "tests/test_grpo_trainer.py"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    ids = [line for line in listed.splitlines() if "::" in line]
    size = -(-len(ids) // n)
    return ids[(i - 1) * size : i * size]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="TRL's GRPOTrainer tests against OffPolicyGRPOTrainer, offline")
    p.add_argument("--trl-repo", required=True, help="a git directory of huggingface/trl (a bare clone will do)")
    p.add_argument("--ref", default="main", help="the commit or tag whose tests to run (match the installed TRL)")
    p.add_argument("-k", default=None, help="pytest -k expression: a piece of the file")
    p.add_argument("--piece", default=None, help="I/N: only the I-th of N equal runs of the collected tests (1-based)")
    p.add_argument("--failed-in", default=None, help="a report.json: run only the tests that failed there")
    p.add_argument("--stock", action="store_true", help="the control: TRL's own GRPOTrainer on the same stand-ins")
    p.add_argument("--out", default="/tmp/trl-upstream", help="work folder (stand-ins are built once, kept)")
    p.add_argument("--timeout", type=int, default=170, help="pytest's time limit, seconds")
    args = p.parse_args(argv)
    work = Path(args.out)
    for line in prepare(work, args.trl_repo, args.ref, args.stock):
        print(f"no stand-in: {line}", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # a shared machine: one thread unless the caller chose
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}"]
    cmd += ["-k", args.k] if args.k else []
    if args.failed_in:  # the control's usual input: the tests that failed in our run
        report = json.loads(Path(args.failed_in).read_text())
        cmd += [
            f"tests/test_grpo_trainer.py::{k}" for k, r in report.items() if r["outcome"] == "failed" and k[0] != ":"
        ]
    else:
        cmd += piece(work, env, args.piece) if args.piece else ["tests/test_grpo_trainer.py"]
    try:
        subprocess.run(cmd, cwd=work, env=env, timeout=args.timeout, check=False, capture_output=True)
    except subprocess.TimeoutExpired:
        print(f"error: pytest ran past {args.timeout} s: choose a smaller piece with -k", file=sys.stderr)
        return 2
    results = outcomes(junit)
    report = work / ("report-stock.json" if args.stock else "report.json")
    merged = json.loads(report.read_text()) if report.exists() else {}
    merged.update(results)
    report.write_text(json.dumps(merged, indent=1) + "\n")
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "failed", "skipped")}
    total = {k: sum(r["outcome"] == k for r in merged.values()) for k in ("passed", "failed", "skipped")}
    print(f"this piece: {counts}; all pieces so far ({report.name}): {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
