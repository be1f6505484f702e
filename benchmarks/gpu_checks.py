"""The GPU check's correctness checks as a plain script (benchmarks/gpu_check.sh's first stage):

    python -m benchmarks.gpu_checks                 # on CUDA where there is one, else on the CPU
    python -m benchmarks.gpu_checks --device cpu    # the CPU: the static cache runs eagerly, without a graph

It needs torch, transformers and this checkout, nothing else: no pytest and nothing from tests/ (the GPU machine
has neither); peft for the LoRA rows, which say "skipped: peft not installed" without it. The constructions (the
tiny Qwen2, a random Llama config, a random LoRA adapter, left-padded arithmetic prompts) are those of
tests/test_fastpath.py and tests/test_gpu_path.py, written here so that they run where tests/ is absent; the tests
take the Llama from here.

Each check prints one line, "ok/FAILED/skipped: <name>: <figures>", as it ends; then one table of them all and, last,
one JSON line with every check's result and figures. The exit status is 1 if any check failed.

    graph <model>           the static-cache sampler's path: on CUDA `sampling_path(model, True)` says
                            "static-cache+cuda-graph" and a graph was captured and replayed (counted at
                            torch.cuda.CUDAGraph); on the CPU it says "static-cache" and decodes eagerly
    greedy <model>          float32 greedy tokens identical to rollout.sample's (the plain loop), log-probs within
                            GREEDY_LOGP_TOL
    update <model>          after an optimizer step (AdamW, weights changed in place) the static sampler, its decoder
                            and graph reused, decodes greedily as the plain loop does on the updated model, and its
                            tokens differ from before the step (the step changes them: otherwise it shows nothing)
    update bf16 <model>     the same under bf16 autocast, where the decoder samples on its own bf16 cast of the
                            weights: the reused decoder (and graph) gives what a fresh one on a copy of the updated
                            model gives (tokens identical), and tokens differ from before the step
    chunked <dtype>         engine.chunked_logprobs.chunked_token_logprobs against logprobs.token_logprobs (the
                            textbook), values and gradients, on the shipped tiny policy and a random Llama, float32
                            and under bf16 autocast (the CPU's too), within CHUNKED_BOUNDS
    mismatch <dtype>        a tiny training run (train.main, 4 steps, v = 2, --sampling fast): the mean over its
                            steps of metrics.jsonl's sampler_mismatch below MISMATCH_BOUNDS[dtype]

The <model>s are qwen2 (engine.tiny's shape), llama (a Llama config) and qwen2+lora (peft, all-linear, r = 4).
"""

import argparse
import contextlib
import copy
import io
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's top-level modules, however the script is started

from engine import decoding, tiny  # noqa: E402
from engine.chunked_logprobs import chunked_token_logprobs  # noqa: E402
from engine.decoding import sampling_path, static_sampler  # noqa: E402
from logprobs import token_logprobs  # noqa: E402
from problems.tasks import Problem, encode_prompts  # noqa: E402
from rollout import generate  # noqa: E402

# --- bounds, each from a figure measured on the CPU (torch 2.13.0+cpu, transformers 5.25, this checkout) ----------

# greedy and update <model>, float32: the static cache's log-probs against the plain loop's. Measured on the CPU
# 2.4e-7 (qwen2, llama) to 7.2e-7 (qwen2+lora); bounds tests/test_fastpath.py's, 1e-5 on the CPU (14x) and 1e-4 on
# CUDA (another attention kernel for each path's shapes there).
GREEDY_LOGP_TOL = {"cpu": 1e-5, "cuda": 1e-4}

# chunked <dtype>: (value, gradient) bounds of chunked against textbook, the worst over both models. value: max
# |logp gap| over the scored tokens; gradient: ||g_chunked - g_textbook|| / ||g_textbook|| over all parameters.
# Measured on the CPU, 8 rollout seeds x 2 models: float32 at most 5.1e-7 (value) and 1.1e-6 (gradient), bounds
# 1e-5 and 1e-5 (about 10x: the same float32 sums in another order, a CUDA kernel's included). Under bf16 autocast
# at most 4.2e-3 (value: the chunked path runs a group's prompt once, the textbook each row's, so their bf16
# attention rounds apart) and 1.2e-2 (gradient), bounds 2e-2 and 6e-2 (5x). Beside them, as tests/test_gpu_path.py
# asks, chunked's own bf16 error against the float32 textbook at most CHUNKED_ERR_RATIO times the textbook's own:
# measured at most 1.16 (the textbook's own bf16 error was 2.4e-3 to 9.7e-2 in value, 4.7e-3 to 0.13 in gradient).
CHUNKED_BOUNDS = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 6e-2)}
CHUNKED_ERR_RATIO = 1.5

# mismatch <dtype>: the mean over the run's steps of sampler_mismatch (metrics.jsonl, 6 decimals). float32: measured
# 0 to 1e-6 a step on the CPU; bound 1e-4 (tests/test_gpu_path.py's), 100x. bfloat16: measured on the CPU, this
# run's shape over seeds 0-9, a mean of 1.0e-3 to 2.0e-3 (1.8e-3 at seed 0, the seed used here; single steps up to
# 7.8e-3); bound 1e-2 = 5x the worst mean measured (the sampler and the training forward round in bf16 in different
# orders, and another device's kernels move that; a sampler on stale weights put its log-probs 0.3 to 0.6 off in
# the update checks, tried here).
MISMATCH_BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2}

PROMPTS = [Problem("12+3=", "15"), Problem("4*4=", "16"), Problem("123-45=", "78")]


class Skipped(Exception):
    """The check cannot run here (an extra is not installed): reported as skipped, not failed."""


# --- the models (tests/test_gpu_path.py's too: it builds its Llama with tiny_llama) ------------------------------


def tiny_qwen2(tok, seed=0):
    return tiny.build_model(tok, seed=seed)


def tiny_llama(tok, seed=0):
    """A random-weight Llama (SmolLM2's family), built from a config: no layer_types in its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def tiny_lora(tok, seed=0):
    """The tiny Qwen2 under a peft LoRA adapter, random (not zero) so that it changes the logits."""
    try:
        import peft
    except ImportError as e:
        raise Skipped("peft not installed" if e.name == "peft" else f"peft not importable ({e})") from None
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    base = tiny_qwen2(tok, seed)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, config)


def shipped_policy(tok, seed=0):
    """engine.tiny's shipped, warmed-up policy (tiny_policy/): confident logits, where bf16 rounding shows most."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.SHIPPED)


MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama, "qwen2+lora": tiny_lora}


# --- counting graph captures and replays, whatever decoding.py's internals --------------------------------------


class GraphCount:
    """Counts the CUDA graphs captured and replayed while active (decoding.py makes torch.cuda.CUDAGraph() when it
    captures): the evidence that the sampler ran as a graph, and that a later call replayed it rather than
    capturing anew."""

    def __init__(self):
        self.captures = self.replays = 0

    @contextlib.contextmanager
    def watching(self):
        real, count = torch.cuda.CUDAGraph, self

        class Counted(real):
            def capture_end(self):
                super().capture_end()
                count.captures += 1

            def replay(self):
                super().replay()
                count.replays += 1

        torch.cuda.CUDAGraph = Counted
        try:
            yield self
        finally:
            torch.cuda.CUDAGraph = real


# --- helpers ------------------------------------------------------------------------------------------------------


def bf16(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def sample(model, tok, ids, mask, fast, temperature=0.0, seed=None, group_size=2, max_new_tokens=10, ignore_eos=True):
    """generate() on the plain loop (fast=False) or the static-cache sampler (fast=True; a graph on CUDA)."""
    generator = None if seed is None else torch.Generator(device=ids.device).manual_seed(seed)
    return generate(
        model,
        ids,
        mask,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        ignore_eos=ignore_eos,
        generator=generator,
        sampler=static_sampler(True) if fast else None,
    )


def logp_gap(a, b) -> float:
    return (a.sampler_logp - b.sampler_logp).abs().max().item()


def optimizer_step(model, ro):
    """One AdamW step that lowers the log-probs of the rollout's own tokens (textbook log-probs): every trainable
    weight changes in place, by about lr, in the direction that changes the greedy tokens."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    logp = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)  # (N, T)
    (logp.sum() / ro.completion_mask.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# --- the checks: each returns (ok, figures) or raises Skipped -------------------------------------------------------


class Checks:
    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.tok = tiny.build_tokenizer()
        self.ids, self.mask = encode_prompts(self.tok, PROMPTS, device)
        self.graphs = GraphCount()

    def model(self, family, seed=0):
        return MODELS[family](self.tok, seed).to(self.device).eval()

    def graph(self, family):
        model = self.model(family)
        path = sampling_path(model, True)
        with self.graphs.watching() as g:
            c0, r0 = g.captures, g.replays
            sample(model, self.tok, self.ids, self.mask, fast=True)
            captures, replays = g.captures - c0, g.replays - r0
        figures = dict(path=path, captures=captures, replays=replays)
        if self.cuda:
            graph_ok = captures == 1 and replays >= 9 and model not in decoding._NO_GRAPH
            ok = path == "static-cache+cuda-graph" and graph_ok
        else:
            ok, figures["note"] = path == "static-cache" and captures == 0, "eager static cache (no CUDA here)"
        return ok, figures

    def greedy(self, family):
        model = self.model(family)
        plain = sample(model, self.tok, self.ids, self.mask, fast=False)
        fast = sample(model, self.tok, self.ids, self.mask, fast=True)
        same = torch.equal(plain.completion_ids, fast.completion_ids)
        gap, tol = logp_gap(plain, fast), GREEDY_LOGP_TOL[self.device.type]
        figures = dict(
            tokens_equal=f"{int((plain.completion_ids == fast.completion_ids).sum())}/{plain.completion_ids.numel()}",
            logp_gap=gap,
            bound=tol,
        )
        return same and gap <= tol, figures

    def update(self, family):
        model = self.model(family)
        tok, ids, mask = self.tok, self.ids, self.mask
        with self.graphs.watching() as g:
            before = sample(model, tok, ids, mask, fast=True)  # the decoder (and graph) made on the old weights
            optimizer_step(model, before)
            c0, r0 = g.captures, g.replays
            after = sample(model, tok, ids, mask, fast=True)  # the same decoder: its graph replayed
            captures, replays = g.captures - c0, g.replays - r0
        plain = sample(model, tok, ids, mask, fast=False)
        changed = int((before.completion_ids != plain.completion_ids).sum())
        same = torch.equal(after.completion_ids, plain.completion_ids)
        gap, tol = logp_gap(after, plain), GREEDY_LOGP_TOL[self.device.type]
        figures = dict(
            tokens_changed_by_step=f"{changed}/{plain.completion_ids.numel()}",
            equal_plain=same,
            logp_gap=gap,
            bound=tol,
        )
        reused = captures == 0 and (replays >= 9 if self.cuda else True)
        if self.cuda:
            figures.update(new_captures=captures, replays=replays)
        return same and gap <= tol and changed > 0 and reused, figures

    def update_bf16(self, family):
        model = self.model(family)
        tok, ids, mask = self.tok, self.ids, self.mask
        with self.graphs.watching() as g:
            with bf16(self.device):
                before = sample(model, tok, ids, mask, fast=True)
            optimizer_step(model, before)  # outside autocast, as train.update's backward and step
            c0, r0 = g.captures, g.replays
            with bf16(self.device):
                after = sample(model, tok, ids, mask, fast=True)  # the reused decoder: its bf16 weights refreshed
            captures, replays = g.captures - c0, g.replays - r0
            fresh_model = copy.deepcopy(model)  # another model object: a decoder (and graph) of its own, cast anew
            with bf16(self.device):
                fresh = sample(fresh_model, tok, ids, mask, fast=True)
                plain = sample(model, tok, ids, mask, fast=False)
        changed = int((before.completion_ids != after.completion_ids).sum())
        same = torch.equal(after.completion_ids, fresh.completion_ids)
        gap = logp_gap(after, fresh)
        n = after.completion_ids.numel()
        figures = dict(
            tokens_changed_by_step=f"{changed}/{n}",
            equal_fresh_decoder=same,
            logp_gap_fresh=gap,
            plain_loop_agrees=f"{int((after.completion_ids == plain.completion_ids).sum())}/{n}",
        )
        reused = captures == 0 and (replays >= 9 if self.cuda else True)
        if self.cuda:
            figures.update(new_captures=captures, replays=replays)
        # The same decoder code on the same weights: identical up to a kernel's order (1e-3: bf16's resolution).
        return same and gap <= 1e-3 and changed > 0 and reused, figures

    def chunked(self, dtype):
        value_bound, grad_bound = CHUNKED_BOUNDS[dtype]
        amp = dtype == "bfloat16"
        worst = dict(value_gap=0.0, grad_gap=0.0)
        if amp:  # each path's own error against float32's textbook, chunked's over the textbook's
            worst.update(value_err_ratio=0.0, grad_err_ratio=0.0)
        for build in (shipped_policy, tiny_llama):
            model = build(self.tok).to(self.device).eval()
            kw = dict(
                temperature=1.0, seed=0, group_size=4, max_new_tokens=12, ignore_eos=False
            )  # rows of several lengths
            ro = sample(model, self.tok, self.ids, self.mask, fast=False, **kw)
            coef = torch.randn(ro.completion_mask.shape, generator=torch.Generator().manual_seed(1), device="cpu")
            coef = coef.to(self.device)  # (N, T) the same weights on every device
            on = ro.completion_mask.bool()

            def run(fn, autocast):
                """fn's log-probs of the scored tokens (M,) and d sum(coef * logp) / d every parameter, flat."""
                model.zero_grad(set_to_none=True)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
                    logp = fn(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 0.8)
                (logp * coef).sum().backward()  # outside autocast, as train.update's
                grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
                return logp.detach()[on], grads

            chunked = lambda *a: chunked_token_logprobs(*a, chunk=16)  # noqa: E731  several chunks of rows
            value_gap = lambda a, b: (a[0] - b[0]).abs().max().item()  # noqa: E731
            grad_gap = lambda a, b: ((a[1] - b[1]).norm() / b[1].norm()).item()  # noqa: E731
            textbook, ours = run(token_logprobs, amp), run(chunked, amp)
            worst["value_gap"] = max(worst["value_gap"], value_gap(ours, textbook))
            worst["grad_gap"] = max(worst["grad_gap"], grad_gap(ours, textbook))
            if amp:
                exact = run(token_logprobs, False)
                ratio = lambda gap: gap(ours, exact) / max(gap(textbook, exact), 1e-12)  # noqa: E731
                worst["value_err_ratio"] = max(worst["value_err_ratio"], ratio(value_gap))
                worst["grad_err_ratio"] = max(worst["grad_err_ratio"], ratio(grad_gap))
        ok = all(math.isfinite(v) for v in worst.values())
        ok = ok and worst["value_gap"] <= value_bound and worst["grad_gap"] <= grad_bound
        if amp:
            ok = ok and max(worst["value_err_ratio"], worst["grad_err_ratio"]) <= CHUNKED_ERR_RATIO
        bounds = f"{value_bound:g}/{grad_bound:g}" + (f", ratio {CHUNKED_ERR_RATIO:g}" if amp else "")
        return ok, dict(**worst, bounds=bounds)

    def mismatch(self, dtype):
        import train

        bound = MISMATCH_BOUNDS[dtype]
        with tempfile.TemporaryDirectory() as tmp:
            argv = [
                *("--steps", "4", "--offpolicy-steps", "2", "--prompts-per-step", "4", "--group-size", "4"),
                *("--eval-size", "8", "--eval-every", "0", "--seed", "0", "--sampling", "fast"),
                *("--device", str(self.device), "--dtype", dtype, "--no-progress"),
                *("--cache-dir", f"{tmp}/cache", "--out", f"{tmp}/run"),
            ]
            log = io.StringIO()
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                rc = train.main(argv)
            if rc != 0:
                raise RuntimeError(f"train.main exited {rc}: {log.getvalue().strip()[-400:]}")
            rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        values = [r["sampler_mismatch"] for r in rows if "sampler_mismatch" in r]
        if not values:
            return False, dict(error="no sampler_mismatch in metrics.jsonl")
        lines = log.getvalue().splitlines()
        path = next((line for line in lines if line.startswith("sampling path: ")), "")
        path = path.split(";")[0].removeprefix("sampling path: ")
        warned = [line for line in lines if line.startswith("warning: rollout:")]  # the sampler changed path
        mean = sum(values) / len(values)
        figures = dict(mean=mean, max=max(values), steps=len(values), bound=bound, path=path, warnings=len(warned))
        wanted = "static-cache+cuda-graph" if self.cuda else "static-cache"
        # The path from train.py's own line (a figure; should that line change, the warnings still tell a fallback).
        return mean < bound and not warned and path in (wanted, ""), figures


# --- running, reporting ---------------------------------------------------------------------------------------------


def fmt(value) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}" if 0.01 <= abs(value) < 1000 else f"{value:.2e}"
    return str(value)


def rounded(figures: dict) -> dict:
    """Floats to 4 significant digits, for the JSON line."""
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in figures.items()}


def run_checks(device: torch.device) -> list[dict]:
    checks = Checks(device)
    plan = []
    for family in MODELS:
        plan += [
            (f"graph {family}", checks.graph, family),
            (f"greedy {family}", checks.greedy, family),
            (f"update {family}", checks.update, family),
            (f"update bf16 {family}", checks.update_bf16, family),
        ]
    plan += [(f"chunked {d}", checks.chunked, d) for d in ("float32", "bfloat16")]
    plan += [(f"mismatch {d}", checks.mismatch, d) for d in ("float32", "bfloat16")]
    results = []
    for name, fn, arg in plan:
        t0 = time.perf_counter()
        try:
            ok, figures = fn(arg)
            status = "ok" if ok else "FAILED"
        except Skipped as e:
            status, figures = "skipped", dict(reason=str(e))
        except Exception as e:  # a check that raises has failed; the others still run
            traceback.print_exc()
            status, figures = "FAILED", dict(error=f"{type(e).__name__}: {str(e).strip()[:300]}")
        seconds = time.perf_counter() - t0
        text = ", ".join(f"{k} {fmt(v)}" for k, v in figures.items())
        print(f"{status}: {name}: {figures['reason'] if status == 'skipped' else text}", flush=True)
        results.append(dict(name=name, status=status, seconds=round(seconds, 2), figures=rounded(figures)))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda where there is one), cuda or cpu")
    args = p.parse_args(argv)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tf32 = f", TF32 matmuls {torch.backends.cuda.matmul.allow_tf32}" if device.type == "cuda" else ""
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}{tf32}"
    print(f"gpu_checks on {where}: {versions}", flush=True)
    t0 = time.perf_counter()
    results = run_checks(device)
    wall = time.perf_counter() - t0
    print()
    print(f"{'check':<24}{'result':<9}{'s':>6}  figures")
    for r in results:
        f = r["figures"]
        text = f.get("reason") if r["status"] == "skipped" else ", ".join(f"{k} {fmt(v)}" for k, v in f.items())
        print(f"{r['name']:<24}{r['status']:<9}{r['seconds']:>6.1f}  {text}")
    counts = {s.lower(): sum(r["status"] == s for r in results) for s in ("ok", "FAILED", "skipped")}
    failed = [r["name"] for r in results if r["status"] == "FAILED"]
    print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in {wall:.0f} s")
    summary = dict(device=where, torch=torch.__version__, transformers=transformers.__version__, wall_s=round(wall, 1))
    print(json.dumps(dict(summary, **counts, failed_checks=failed, checks=results), default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
