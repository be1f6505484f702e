"""The GPU check's correctness checks as a plain script (benchmarks/gpu_check.sh's first stage):

    python -m benchmarks.gpu_checks                 # on CUDA where there is one, else on the CPU
    python -m benchmarks.gpu_checks --device cpu    # the CPU: the static cache runs eagerly, without a graph
    python -m benchmarks.gpu_checks --only chunked --defect value+0.1   # a defective head: the chunked checks fail
    python -m benchmarks.gpu_checks --only chunked --gemm-noise 3       # bf16 matmuls as another kernel sums them

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
    update <model>          after an optimizer step (AdamW, weights changed in place) the static loop, its decoder
                            and graph reused, decodes greedily as the plain loop does on the updated model, and its
                            tokens differ from before the step (the step changes them: otherwise it shows nothing)
    update bf16 <model>     the same under bf16 autocast, where the decoder samples on its own bf16 cast of the
                            weights: the reused decoder (and graph) gives what a fresh one on a copy of the updated
                            model gives (tokens identical), and tokens differ from before the step
    chunked <dtype>         engine.chunked_logprobs.chunked_token_logprobs against logprobs.token_logprobs (the
                            textbook), values and gradients, on the shipped tiny policy and a random Llama, float32
                            and under bf16 autocast (the CPU's too): float32 within CHUNKED_FLOAT32_BOUNDS, bf16 by
                            each path's own error against the float32 textbook ("judging a bfloat16 path")
    mismatch <dtype>        a tiny training run (train.main, 4 steps, v = 2, --sampling fast): the mean over its
                            steps of metrics.jsonl's sampler_mismatch below MISMATCH_BOUNDS[dtype]

The <model>s are qwen2 (engine.tiny's shape), llama (a Llama config) and qwen2+lora (peft, all-linear, r = 4).
"""

import argparse
import contextlib
import copy
import functools
import io
import json
import math
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's top-level modules, however the script is started

from engine import decoding, tiny  # noqa: E402
from engine.chunked_logprobs import chunked_token_logprobs  # noqa: E402
from engine.decoding import sampling_path, static_loop  # noqa: E402
from logprobs import token_logprobs  # noqa: E402
from problems.tasks import Problem, encode_prompts  # noqa: E402
from rollout import generate  # noqa: E402

# --- bounds, each from a figure measured on the CPU (torch 2.13.0+cpu, transformers 5.25, this checkout) ----------

# greedy and update <model>, float32: the static cache's log-probs against the plain loop's. Measured on the CPU
# 2.4e-7 (qwen2, llama) to 7.2e-7 (qwen2+lora); bounds tests/test_fastpath.py's, 1e-5 on the CPU (14x) and 1e-4 on
# CUDA (another attention kernel for each path's shapes there).
GREEDY_LOGP_TOL = {"cpu": 1e-5, "cuda": 1e-4}

# chunked float32: (value, gradient) bounds of chunked against the float32 textbook, the worst over both models.
# value: max |logp gap| over the scored tokens; gradient: ||g_chunked - g_textbook|| / ||g_textbook|| over all
# parameters. Measured on the CPU, 8 rollout seeds x 2 models: at most 5.1e-7 (value) and 1.1e-6 (gradient), bounds
# 1e-5 and 1e-5 (about 10x: the same float32 sums in another order, a CUDA kernel's included).
CHUNKED_FLOAT32_BOUNDS = (1e-5, 1e-5)

# mismatch <dtype>: the mean over the run's steps of sampler_mismatch (metrics.jsonl, 6 decimals): the mean |log alpha
# while sampling - log alpha of the training forward|. float32: measured 0 to 1e-6 a step on the CPU; bound 1e-4
# (tests/test_gpu_path.py's), 100x. bfloat16: both sides round the logits to bf16, each in its own order, which moves
# a log-prob by a fraction of a bf16 step on average; the bound is one bf16 step of a log-prob of magnitude 1 (2^-7,
# bf16_step(1)). Measured on the CPU, this run's shape over seeds 0-9: a mean of 1.0e-3 to 2.0e-3 (0.13 to 0.26 of
# that step; single steps up to 7.8e-3); a sampler on stale weights put its log-probs 0.3 to 0.6 off in the update
# checks (tried here): 40 steps and more.
MISMATCH_BOUNDS = {"float32": 1e-4, "bfloat16": 2.0**-7}

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
    captures): the evidence that the sampling loop ran as a graph, and that a later call replayed it rather than
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
        loop=static_loop(True) if fast else None,
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


# --- judging a bfloat16 path: against float32's textbook, each path's own error ------------------------------------
#
# Under bf16 autocast no two paths agree to a fixed number: each rounds the logits to bf16 in its own order (a
# shared-prompt pass, chunks of rows, another GPU kernel's tiles), and one bf16 step of a confident model's logits
# (|z| ~ 10: a step of 2^-4) is larger than any bound tuned on one CPU. So a bf16 path is judged by its own error
# against the float32 textbook, beside the bf16 textbook's own error on the same batch:
#
#     err(path) <= BF16_ERR_RATIO * err(textbook) + floor,   floor = BF16_FLOOR_STEPS[quantity] * step(quantity)
#
# the floor in units of the quantity's bf16 resolution (for when the textbook's own error is near 0 by chance):
#     value     err = the RMS over the scored tokens of (logp - logp_float32); a log-prob z_y - logsumexp(z) carries
#               the rounding of the logits z it comes from, so its step is one bf16 step of the token's largest |z|
#               (RMS over the tokens);
#     gradient  err = ||g - g_float32|| / ||g_float32|| over all parameters, a relative error: its step is bf16's
#               relative resolution, 2^-8 (half the spacing of bf16 values at 1).
# RMS, not max: a defect is systematic (every token off), bf16 rounding is not, and one token's rounding can reach
# a whole step. Measured (docs/benchmarks.md, "Judging bf16"): chunked's err / bound at most 0.48 (value) and 0.68
# (gradient) over torch's AVX-512, AVX2 and plain CPU kernels x 10 seeds of emulated GEMM noise (30 of 30 pass); the
# defects (DEFECTS) at 28 (value + 0.1) and 34 (gradient x 1.4).
BF16_ERR_RATIO = 1.5
BF16_FLOOR_STEPS = {"value": 0.25, "grad": 1.0}
BF16_RELATIVE_STEP = 2.0**-8


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |x|, elementwise: 2^(e - 8) for |x| = m 2^e with m in [0.5, 1) (bf16 keeps 8
    significant bits), so 2^-7 at 1 and 2^-4 at 10."""
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def bf16_bound(err_textbook: float, step: float, quantity: str) -> float:
    """What a bf16 path's error (against float32's textbook) may reach: BF16_ERR_RATIO times the bf16 textbook's own
    error on the same batch, plus BF16_FLOOR_STEPS[quantity] steps of the quantity's bf16 resolution."""
    return BF16_ERR_RATIO * err_textbook + BF16_FLOOR_STEPS[quantity] * step


def run_path(model, ro, fn, autocast: bool, temperature: float = 0.8):
    """fn's log-probs of ro's scored tokens (M,) and d sum(coef * logp) / d every parameter (flat, float32), the
    forward under bf16 autocast or not, the backward outside it as train.update's; coef (N, T) fixed random weights,
    the same on every device."""
    coef = torch.randn(ro.completion_mask.shape, generator=torch.Generator().manual_seed(1), device="cpu")
    coef = coef.to(ro.input_ids.device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ro.input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logp = fn(model, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature)
    (logp * coef).sum().backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return logp.detach()[ro.completion_mask.bool()], grads


def relative(g: torch.Tensor, g_ref: torch.Tensor) -> float:
    return ((g - g_ref).norm() / g_ref.norm()).item()


def float32_gaps(model, ro, path) -> dict:
    """`path` against the textbook, both in float32: the max |logp gap| and the gradient's relative gap."""
    (v, g), (v_ref, g_ref) = run_path(model, ro, path, False), run_path(model, ro, token_logprobs, False)
    return dict(value_gap=(v - v_ref).abs().max().item(), grad_gap=relative(g, g_ref))


def bf16_errors(model, ro, path, temperature: float = 0.8) -> dict:
    """`path` and the textbook under bf16 autocast, each against the float32 textbook (the rule above): their errors,
    the bound for `path`'s, and err / bound (<= 1 passes) for the value and the gradient."""
    v32, g32 = run_path(model, ro, token_logprobs, False, temperature)
    v_tb, g_tb = run_path(model, ro, token_logprobs, True, temperature)
    v, g = run_path(model, ro, path, True, temperature)
    with torch.no_grad():  # the float32 logits / tau at the scored tokens' positions: their largest |z| each
        t = ro.completion_mask.shape[1]
        pos = ro.attention_mask.long().cumsum(-1).sub(1).clamp(min=0)
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits
        z_max = (logits[:, -t - 1 : -1].float() / temperature).abs().amax(-1)[ro.completion_mask.bool()]  # (M,)
    rms = lambda x: x.float().pow(2).mean().sqrt().item()  # noqa: E731
    value_step = rms(bf16_step(z_max))
    err = dict(value=rms(v - v32), grad=relative(g, g32))
    err_textbook = dict(value=rms(v_tb - v32), grad=relative(g_tb, g32))
    step = dict(value=value_step, grad=BF16_RELATIVE_STEP)
    figures = {}
    for q in ("value", "grad"):
        bound = bf16_bound(err_textbook[q], step[q], q)
        figures.update(
            {f"{q}_err": err[q], f"{q}_err_textbook": err_textbook[q], f"{q}_err_over_bound": err[q] / bound}
        )
    figures["value_step"] = value_step
    return figures


# The two defects the chunked checks must catch (tests/test_gpu_checks.py; `--defect NAME` runs the checks with one):
# log-probs off by +0.1 with an exact gradient, and an exact value whose gradient is 1.4 times too large (the class of
# the autocast bug fixed before: a backward that did not match its forward).
def value_off_by_0_1(*args):
    return chunked_token_logprobs(*args, chunk=16) + 0.1  # a constant: the gradient is untouched


def gradient_times_1_4(*args):
    logp = chunked_token_logprobs(*args, chunk=16)
    return logp + 0.4 * (logp - logp.detach())  # the value is logp's, the gradient 1.4 times logp's


DEFECTS = {"value+0.1": value_off_by_0_1, "gradx1.4": gradient_times_1_4}


# --- emulated GEMM noise: another GPU's matmul kernels, on the CPU ------------------------------------------------


class GemmNoise(TorchDispatchMode):
    """Every bfloat16 matrix product computed in float32, times (1 + rel * noise), then rounded to bfloat16: as if
    another library had summed it in another order (cuBLAS picks its tiles by shape), which moves a value that lies
    near a rounding edge to the next bf16 value. The noise is a fixed function of (seed, op, shapes), as a kernel's
    choice is of the shapes: the same product gives the same result within a run."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self, seed: int, rel: float = 1e-6):
        super().__init__()
        self.seed, self.rel, self.products = seed, rel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func.overloadpacket.__name__ not in self.MATMULS or tensors[0].dtype != torch.bfloat16:
            return func(*args, **kwargs)
        up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        exact = func(*up, **kwargs)  # float32
        key = repr((self.seed, func.overloadpacket.__name__, [tuple(t.shape) for t in tensors]))
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        noise = torch.randn(exact.shape, generator=gen, device="cpu").to(exact.device)
        self.products += 1
        return (exact * (1 + self.rel * noise)).to(torch.bfloat16)


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
                after = sample(model, tok, ids, mask, fast=True)  # the reused decoder: its bf16 weights recast
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
        # The same decoder code on the same weights: identical, up to one bf16 step of the largest log-prob compared
        # (a kernel that sums in another order on another call rounds at most that far apart).
        step = bf16_step(fresh.sampler_logp.abs().max()).item()
        figures["bound"] = step
        return same and gap <= step and changed > 0 and reused, figures

    def chunked(self, dtype, path=None):
        """chunked <dtype>: `path` (default: chunked_token_logprobs in chunks of 16 rows) against the textbook,
        values and gradients, on the shipped policy and a random Llama. float32: the gaps to the float32 textbook
        within CHUNKED_FLOAT32_BOUNDS. bfloat16 (autocast): each path's own error against the float32 textbook,
        `path`'s within `bf16_bound` of the bf16 textbook's (`bf16_errors` says how each error is measured)."""
        path = path or (lambda *a: chunked_token_logprobs(*a, chunk=16))  # several chunks of rows
        amp = dtype == "bfloat16"
        worst = {}
        for build in (shipped_policy, tiny_llama):
            model = build(self.tok).to(self.device).eval()
            kw = dict(
                temperature=1.0, seed=0, group_size=4, max_new_tokens=12, ignore_eos=False
            )  # rows of several lengths
            ro = sample(model, self.tok, self.ids, self.mask, fast=False, **kw)
            figures = bf16_errors(model, ro, path) if amp else float32_gaps(model, ro, path)
            for k, v in figures.items():
                worst[k] = max(worst.get(k, v), v)
        if amp:  # err_over_bound <= 1 passes: the worst over the two models, value and gradient each
            ok = worst["value_err_over_bound"] <= 1 and worst["grad_err_over_bound"] <= 1
        else:
            ok = worst["value_gap"] <= CHUNKED_FLOAT32_BOUNDS[0] and worst["grad_gap"] <= CHUNKED_FLOAT32_BOUNDS[1]
        ok = ok and all(math.isfinite(v) for v in worst.values())
        return ok, worst

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
        warned = [line for line in lines if line.startswith("warning: rollout:")]  # the sampling loop changed path
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


def run_checks(device: torch.device, only: str = "", defect: str | None = None) -> list[dict]:
    """Every check, or those whose name contains one of `only`'s comma-separated parts; with `defect`, the chunked
    checks run that defective head (DEFECTS) instead of chunked_token_logprobs, and must fail."""
    checks = Checks(device)
    plan = []
    for family in MODELS:
        plan += [
            (f"graph {family}", checks.graph, family),
            (f"greedy {family}", checks.greedy, family),
            (f"update {family}", checks.update, family),
            (f"update bf16 {family}", checks.update_bf16, family),
        ]
    path = DEFECTS[defect] if defect else None
    plan += [(f"chunked {d}", functools.partial(checks.chunked, path=path), d) for d in ("float32", "bfloat16")]
    plan += [(f"mismatch {d}", checks.mismatch, d) for d in ("float32", "bfloat16")]
    plan = [item for item in plan if any(part in item[0] for part in only.split(","))]
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
    p.add_argument(
        "--only",
        default="",
        help="run only the checks whose name contains one of these (comma-separated, e.g. chunked,bf16)",
    )
    p.add_argument("--defect", choices=sorted(DEFECTS), help="the chunked checks on a defective head: they must fail")
    p.add_argument(
        "--gemm-noise", type=int, metavar="SEED", help="every bf16 matmul summed as another kernel would (GemmNoise)"
    )
    args = p.parse_args(argv)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tf32 = f", TF32 matmuls {torch.backends.cuda.matmul.allow_tf32}" if device.type == "cuda" else ""
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}{tf32}"
    extra = "".join(
        f", {k} {v}" for k, v in (("defect", args.defect), ("gemm noise seed", args.gemm_noise)) if v is not None
    )
    print(f"gpu_checks on {where}: {versions}{extra}", flush=True)
    t0 = time.perf_counter()
    noise = GemmNoise(args.gemm_noise) if args.gemm_noise is not None else contextlib.nullcontext()
    with noise:
        results = run_checks(device, args.only, args.defect)
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
