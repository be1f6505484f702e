"""The GPU path's code, run on the CPU: bf16 autocast, the static-cache sampler, generators on another device,
out-of-memory, so that a lent GPU confirms these rather than discovers them (benchmarks/gpu_check.sh runs them
there too).

Each check is against something independent: float32 autograd of the textbook log-softmax for the gradients, the
plain sampling loop for the static-cache one, a patched torch function for the device of random calls.
"""

import ast
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.chunked_logprobs import SelectedLogProb
from engine.decoding import static_loop

ROOT = Path(__file__).resolve().parents[1]
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


# --- 1. the chunked log-prob's backward honours autocast -----------------------------------------------------


def confident_head(scale: float, m: int = 64, h: int = 64, v: int = 512, seed: int = 0):
    """Hidden states (M, H), a head W (V, H) of the given scale, targets = argmax(h W^T) (a confident model: the
    target's probability near 1, where a softmax that does not match its log-sum-exp is furthest off), and
    random weights (M,) of the log-probs in the loss."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g)
    weight = scale * torch.randn(v, h, generator=g) / 2
    return hidden, weight, (hidden @ weight.T).argmax(1), torch.randn(m, generator=g)


def plain_logp(hidden, weight, targets):
    """The textbook: log_softmax of the float32 logits, autograd's own backward."""
    return torch.log_softmax(F.linear(hidden, weight).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def chunked_logp(hidden, weight, targets):
    return SelectedLogProb.apply(hidden, weight, None, targets, 1.0, 16, None)


def grads(logp_fn, hidden, weight, targets, coef, autocast: bool):
    """d sum(coef * logp) / d (hidden, weight), the forward under bf16 autocast or not; backward outside it, as
    train.update calls loss.backward()."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(**BF16, enabled=autocast):
        logp = logp_fn(h, w, targets)
    (logp * coef).sum().backward()
    return h.grad, w.grad


@pytest.mark.parametrize("scale", [1, 2, 4])
def test_chunked_gradients_under_bf16_autocast_are_as_good_as_autograds_own(scale):
    hidden, weight, targets, coef = confident_head(scale)
    exact = grads(plain_logp, hidden, weight, targets, coef, autocast=False)  # float32 throughout
    plain = grads(plain_logp, hidden, weight, targets, coef, autocast=True)
    chunked = grads(chunked_logp, hidden, weight, targets, coef, autocast=True)
    rel = lambda g, ref: ((g - ref).norm() / ref.norm()).item()  # noqa: E731
    for name, p, c, e in zip(("hidden", "weight"), plain, chunked, exact):
        err_plain, err_chunked = rel(p, e), rel(c, e)
        assert err_plain > 1e-3, "bf16 must round visibly here, or the comparison shows nothing"
        assert err_chunked <= 1.5 * err_plain, f"{name}: chunked {err_chunked:.4f} vs autograd's {err_plain:.4f}"


class MatmulLog(TorchDispatchMode):
    """Every matrix product that runs inside the block: (op name, dtypes of its tensor inputs, their shapes, whether
    every input's values are bfloat16 numbers)."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            bf16_values = all(torch.equal(t, t.bfloat16().to(t.dtype)) for t in tensors)
            self.calls.append(
                (
                    func.overloadpacket.__name__,
                    [t.dtype for t in tensors],
                    [tuple(t.shape) for t in tensors],
                    bf16_values,
                )
            )
        return func(*args, **(kwargs or {}))


def test_no_float32_matmul_of_vocabulary_size_runs_in_the_backward_under_autocast():
    # Per chunk: the logits again and d hidden in bfloat16; d weight from bfloat16 operands into a float32 sum
    # (chunked_logprobs.add_product): torch.mm's out_dtype on CUDA, and where torch has no such kernel (this CPU)
    # a float32 matmul of the same bfloat16 numbers, upcast. Nothing of vocabulary size multiplies float32 numbers.
    hidden, weight, targets, coef = confident_head(2)
    v = weight.shape[0]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(**BF16):
        logp = chunked_logp(h, w, targets)
    with MatmulLog() as log:
        (logp * coef).sum().backward()
    vocab_sized = [c for c in log.calls if any(v in shape for shape in c[2])]
    assert len(vocab_sized) == 3 * 4, log.calls  # per chunk: the logits again, then d hidden and d weight
    logits_and_d_hidden = [c for i, c in enumerate(vocab_sized) if i % 3 != 2]
    d_weight = vocab_sized[2::3]
    assert all(d == torch.bfloat16 for _, dtypes, _, _ in logits_and_d_hidden for d in dtypes), vocab_sized
    assert all(shapes[0] == (v, 16) and bf16 for _, _, shapes, bf16 in d_weight), d_weight


# --- 2. every random call with a generator names its device ---------------------------------------------------

# torch's factories of random numbers: without device= they draw on the default device, and a CUDA generator
# there is an error ("Expected a 'cpu' device type for generator"). Functions that take a tensor (multinomial,
# Tensor.uniform_) draw on its device.
FACTORIES = {"randperm", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "normal"}
CODE_FOLDERS = [ROOT, ROOT / "benchmarks", ROOT / "integrations", ROOT / "studies"]


def random_calls_without_device(folders=CODE_FOLDERS, root=ROOT):
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                names = {k.arg for k in node.keywords}
                if node.func.attr in FACTORIES and "generator" in names and "device" not in names:
                    yield f"{path.relative_to(root)}:{node.lineno}"


def test_every_random_factory_given_a_generator_is_given_its_device():
    assert list(random_calls_without_device()) == []


def test_the_scan_finds_a_call_without_device(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\nx = torch.randperm(4, generator=g)\n")
    assert list(random_calls_without_device([tmp_path], tmp_path)) == ["bad.py:2"]


class OtherDevice:
    """torch.randperm as if the generator lived on another device than torch's default: a call without
    device=generator.device fails, as it does on CUDA."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, torch.randperm

        def randperm(n, *, generator=None, device=None, **kw):
            if generator is not None:
                assert device is not None and torch.device(device) == generator.device, "randperm without its device"
                self.calls += 1
            return real(n, generator=generator, device=device, **kw)

        monkeypatch.setattr(torch, "randperm", randperm)


def test_red_drop_and_the_reward_shuffle_draw_on_their_generators_device(monkeypatch):
    import variants
    from config import Config

    patched = OtherDevice(monkeypatch)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # two groups of 4, one positive each
    cfg = Config(group_size=4, red="drop", reward_shuffle=True)
    advantages, valid = variants.recipe(cfg).advantages(rewards, torch.Generator().manual_seed(0))
    assert patched.calls == 3  # one shuffle, one drop per group
    assert valid.sum() == 4  # RED-Drop kept one positive and one negative per group


# --- 3. the static-cache sampler (--sampling fast) on the model families a user brings -------------------------


def tiny_llama(tok, seed: int = 0):
    """A random-weight Llama (SmolLM2's family): the GPU check's own (one construction for both)."""
    from benchmarks.gpu_checks import tiny_llama as llama

    return llama(tok, seed).eval()


def tiny_qwen2(tok, seed: int = 0):
    from engine import tiny

    return tiny.build_model(tok, seed=seed).eval()


def tiny_lora(tok, seed: int = 0):
    """The tiny Qwen2 wrapped by peft LoRA, its adapter random (not zero) so that it changes the logits."""
    from conftest import needs

    peft = needs("peft", "lora")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(tiny_qwen2(tok, seed), config).eval()


MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama, "qwen2+lora": tiny_lora}


def left_padded_prompts(tok):
    from problems.tasks import Problem, encode_prompts

    problems = [Problem("12+3=", "15"), Problem("4*4=", "16"), Problem("123-45=", "78")]
    return encode_prompts(tok, problems, "cpu")


def sample_both_ways(model, tok, temperature=0.0, **kw):
    from rollout import generate

    ids, mask = left_padded_prompts(tok)
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    args = dict(group_size=2, max_new_tokens=10, temperature=temperature, ignore_eos=True, **special, **kw)
    return generate(model, ids, mask, **args), generate(model, ids, mask, loop=static_loop(True), **args)


@pytest.mark.model
@pytest.mark.parametrize("family", MODELS)
def test_the_static_cache_loop_matches_the_plain_loop(tok, family):
    from engine.decoding import sampling_path

    model = MODELS[family](tok)
    assert sampling_path(model, fast=True) == "static-cache"  # it applies: no silent fallback to plain
    plain, fast = sample_both_ways(model, tok)
    assert torch.equal(plain.completion_ids, fast.completion_ids)
    assert (plain.sampler_logp - fast.sampler_logp).abs().max() <= 1e-5
    assert (plain.entropy - fast.entropy).abs().max() <= 1e-5


@pytest.mark.model
@pytest.mark.parametrize("family", MODELS)
def test_the_static_cache_loop_under_bf16_autocast_keeps_its_cache_in_bf16(tok, family):
    from benchmarks.gpu_checks import bf16_bound, bf16_step
    from engine import decoding
    from logprobs import position_ids_from_mask, token_logprobs

    model = MODELS[family](tok)
    with torch.autocast(**BF16):
        plain, fast = sample_both_ways(model, tok)
        (decoder,) = decoding._DECODERS[model].values()
        dtypes = {t.dtype for t in (*decoder.keys.values(), *decoder.values.values())}
        assert dtypes == {torch.bfloat16} and len(decoder.keys) == model.config.num_hidden_layers
        assert torch.equal(plain.completion_ids, fast.completion_ids)
        sampled = sample_both_ways(model, tok, temperature=1.0, generator=torch.Generator().manual_seed(0))
    # Sampled: each path's log alpha against the float32 textbook's on its own tokens (each path's own bf16 error,
    # benchmarks/gpu_checks.py's rule): the static path's within bf16_bound of the plain loop's. The attention casts
    # keys to bf16 in both, so the bf16 cache costs nothing.
    err, step = [], []
    for ro in sampled:
        exact = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)  # float32
        on = ro.completion_mask.bool()
        err.append((ro.sampler_logp - exact)[on].pow(2).mean().sqrt().item())
        with torch.no_grad():
            pos = position_ids_from_mask(ro.attention_mask)
            logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits
        logits = logits[:, -on.shape[1] - 1 : -1]  # (N, T, V) the logits that score each completion token
        step.append(bf16_step(logits.abs().amax(-1)[on]).pow(2).mean().sqrt().item())
    (plain_err, fast_err), value_step = err, max(step)
    assert plain_err > 0, "bf16 must round visibly here, or the comparison shows nothing"
    assert fast_err <= bf16_bound(plain_err, value_step, "value"), (plain_err, fast_err, value_step)


class CastLog(TorchDispatchMode):
    """How many times a dtype cast reads one of the given tensors (the model's weights)."""

    def __init__(self, model):
        super().__init__()
        self.ptrs, self.casts = {p.data_ptr() for p in model.parameters()}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_to_copy" and args[0].data_ptr() in self.ptrs:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.model
def test_the_static_decoder_casts_no_weight_per_token_under_autocast(tok):
    # A captured graph runs without autocast's cast cache (decoding.StaticDecoder._capture): the eager step, with the
    # cache off as there, shows what each replay would do. The decoder makes its bf16 copies of the Linear weights
    # once, then refreshes them by copy_ at each call; the plain loop, for contrast, casts every Linear weight at
    # every token.
    from rollout import generate

    model = tiny_qwen2(tok)
    ids, mask = left_padded_prompts(tok)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    sample = lambda fast: generate(  # noqa: E731
        model,
        ids,
        mask,
        group_size=2,
        max_new_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        loop=static_loop(fast),
        **special,
    )
    casts = {}
    for fast in (False, True):
        with torch.autocast(**BF16, cache_enabled=False):
            sample(fast)  # the static decoder is made here, its copies with it
            with CastLog(model) as log:
                sample(fast)
        casts[fast] = log.casts
    assert casts[False] >= 10 * n_linear
    assert casts[True] == 0


@pytest.mark.model
def test_the_static_decoders_of_one_model_share_one_cast_of_its_weights(tok):
    # Training's and evaluation's shapes each keep a decoder (up to decoding.MAX_DECODERS); their bf16 copies of the
    # Linear weights are one set, not one per shape, and each refreshes it from the current weights.
    from engine import decoding
    from rollout import generate

    model = tiny_qwen2(tok)
    ids, mask = left_padded_prompts(tok)
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=0.0, ignore_eos=True)
    with torch.autocast(**BF16):
        for group_size in (1, 2, 4):  # three shapes, three decoders
            generate(model, ids, mask, group_size=group_size, max_new_tokens=4, loop=static_loop(True), **special)
    decoders = list(decoding._DECODERS[model].values())
    assert len(decoders) == 3
    first = decoders[0].weights
    assert first and all(d.weights.keys() == first.keys() for d in decoders)
    assert all(d.weights[k].data_ptr() == first[k].data_ptr() for d in decoders for k in first)  # one storage
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if n in first).add_(1.0)  # an optimizer step, in place
    with torch.autocast(**BF16):
        generate(model, ids, mask, group_size=1, max_new_tokens=4, loop=static_loop(True), **special)
    name = next(iter(first))
    assert torch.equal(first[name], dict(model.named_parameters())[name].detach().to(torch.bfloat16))


@pytest.mark.model
def test_evaluations_shape_does_not_evict_the_training_decoder(tok):
    from engine import decoding

    model = tiny_qwen2(tok)
    sample_both_ways(model, tok)  # 6 rows: "training"
    (training,) = decoding._DECODERS[model].values()
    from rollout import generate

    ids, mask = left_padded_prompts(tok)
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    generate(
        model, ids, mask, group_size=1, max_new_tokens=10, temperature=0.0, loop=static_loop(True), **special
    )  # 3 rows
    sample_both_ways(model, tok)
    assert len(decoding._DECODERS[model]) == 2 and training in decoding._DECODERS[model].values()


@pytest.mark.model
def test_a_model_whose_tensors_moved_gets_a_new_decoder_even_where_the_embedding_stayed(tok):
    # A captured graph reads every weight by address. The old key held the embedding's address alone: moving every
    # other tensor (here a clone each, as `.to` or load_state_dict(assign=True) would) kept that key, and the old
    # graph would have read freed memory. The layout of every parameter and buffer is the key now.
    from engine import decoding

    model = tiny_qwen2(tok)
    sample_both_ways(model, tok)
    (old,) = decoding._DECODERS[model].values()
    embedding = model.get_input_embeddings().weight
    for p in model.parameters():
        if p is not embedding:
            p.data = p.data.clone()
    plain, fast = sample_both_ways(model, tok)
    assert old not in decoding._DECODERS[model].values() and len(decoding._DECODERS[model]) == 1
    assert torch.equal(plain.completion_ids, fast.completion_ids)
    sample_both_ways(model, tok)  # unmoved since: the same decoder again, no recapture
    assert len(decoding._DECODERS[model]) == 1 and old not in decoding._DECODERS[model].values()


@pytest.mark.model
def test_a_model_freed_and_another_made_at_the_same_addresses_does_not_reuse_the_old_decoder(tok):
    # The worst case of memory reuse: the second model's every parameter and buffer lives where the freed first one's
    # did (here by construction: the second takes the first's very storages), so their layouts are equal. The first's
    # decoders went with it (a weak key): the old decoder is freed, and the second gets one of its own.
    import gc
    import weakref

    from engine import decoding

    model = tiny_qwen2(tok)
    storages = {n: t.data for n, t in (*model.named_parameters(), *model.named_buffers())}
    sample_both_ways(model, tok)
    (old,) = decoding._DECODERS[model].values()
    old_ref, layout = weakref.ref(old), decoding.tensor_layout(model)
    del model, old
    gc.collect()  # the decoder refers to itself (its forward's cache keyword): a cycle, freed by the collector
    assert old_ref() is None, "the freed model's decoder is gone with it"
    other = tiny_qwen2(tok, seed=1)
    for n, t in (*other.named_parameters(), *other.named_buffers()):
        t.data = storages[n]
    assert decoding.tensor_layout(other) == layout  # the same addresses, names, dtypes and shapes
    plain, fast = sample_both_ways(other, tok)
    assert torch.equal(plain.completion_ids, fast.completion_ids)
    (new,) = decoding._DECODERS[other].values()
    assert new is not old_ref()


@pytest.mark.model
def test_a_failed_graph_capture_falls_back_to_the_plain_loop_with_one_line(tok, monkeypatch, capsys):
    # The CPU pretends to capture graphs, and the capture fails as it can on a GPU (out of memory, an op that
    # cannot be captured): that call samples on the plain loop, from the same generator state, and later calls too.
    from engine import decoding
    from rollout import generate

    monkeypatch.setattr(decoding, "graphs_on", lambda device: True)

    def capture(self, model):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(decoding.StaticDecoder, "_capture", capture)
    monkeypatch.setattr(decoding, "sampling_path", lambda m, fast=None: "plain" if fast is False else "static-cache")
    model = tiny_qwen2(tok)
    ids, mask = left_padded_prompts(tok)
    kw = dict(
        group_size=2, max_new_tokens=8, temperature=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    ro = generate(model, ids, mask, loop=static_loop(None), generator=torch.Generator().manual_seed(3), **kw)  # auto
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "CUDA graph failed" in err[0] and "OutOfMemoryError" in err[0], err
    plain = generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(ro.completion_ids, plain.completion_ids)
    # The fallback reads the cache with grouped heads folded (engine.decoding.folded_gqa); the reference `sample`
    # under transformers 5.17 repeats K/V instead: the same sums in another order, so equal to float32's rounding.
    torch.testing.assert_close(ro.sampler_logp, plain.sampler_logp, rtol=0, atol=1e-6)
    assert model in decoding._NO_FAST and model not in decoding._DECODERS
    generate(
        model, ids, mask, loop=static_loop(None), generator=torch.Generator().manual_seed(3), **kw
    )  # no second capture, no second line
    assert capsys.readouterr().err == ""


# --- 4. train.py: --sampling, out of memory, evaluation under autocast ------------------------------------------


def tiny_args(cache, out, *extra):
    from conftest import TEST_WARMUP

    return [
        *("--steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--eval-size", "8", "--eval-every", "0"),
        *("--offpolicy-steps", "2", "--save-every", "1", "--warmup-steps", str(TEST_WARMUP)),
        *("--cache-dir", cache, "--out", str(out), "--no-progress", *extra),
    ]


@pytest.mark.model
def test_out_of_memory_in_a_step_is_one_line_naming_the_levers_and_the_checkpoint_stays(
    warm_cache, tmp_path, monkeypatch, capsys
):
    import transformers

    import train
    from bookkeeping.checkpoint import latest_checkpoint

    real, calls = transformers.Qwen2Model.forward, []

    @functools.wraps(real)  # the same signature, so the caller still sees `cache` among its parameters
    def forward(self, *a, **kw):  # the third update's forward (step 2) runs out of memory, as on a GPU
        calls.append(torch.is_grad_enabled())
        if sum(calls) == 3 and calls[-1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")
        return real(self, *a, **kw)

    monkeypatch.setattr(transformers.Qwen2Model, "forward", forward)
    assert train.main(tiny_args(warm_cache, tmp_path / "run")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and err[0].startswith("error: out of memory (CUDA out of memory"), err
    assert "--micro-batch" in err[0] and "--sample-rows" in err[0], err
    kept = latest_checkpoint(str(tmp_path / "run"))
    assert kept is not None and kept.name in err[0] and "1 of 4 steps done" in err[0], err
    # The resume the line suggests, with a smaller micro-batch (a memory knob a resume may change).
    monkeypatch.setattr(transformers.Qwen2Model, "forward", real)
    assert train.main(["--resume", "--out", str(tmp_path / "run"), "--micro-batch", "4", "--no-progress"]) == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


@pytest.mark.model
def test_sampling_fast_trains_on_the_static_cache_and_survives_a_failed_capture(
    warm_cache, tmp_path, monkeypatch, capsys
):
    import json

    import train
    from engine import decoding

    # The CPU pretends to capture graphs; the capture fails: one line, and the run goes on to its end.
    monkeypatch.setattr(decoding, "graphs_on", lambda device: True)
    monkeypatch.setattr(decoding.StaticDecoder, "_capture", lambda self, model: 1 / 0)
    assert train.main(tiny_args(warm_cache, tmp_path / "run", "--sampling", "fast")) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "ZeroDivisionError" in warned[0], warned
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mismatch = [row["sampler_mismatch"] for row in rows if "sampler_mismatch" in row]
    assert len(rows) == 4 and len(mismatch) == 4 and max(mismatch) < 1e-4, rows


def test_evaluation_samples_under_the_training_autocast(warm_cache, tmp_path, monkeypatch):
    # The run's held-out evaluation samples as its training does: the same loop (--sampling), the same autocast.
    import bookkeeping.evaluation
    import train

    seen = []

    def generate(*a, loop=None, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), loop))
        raise StopIteration  # nothing to score: the state at the call is the test

    monkeypatch.setattr(bookkeeping.evaluation, "generate", generate)
    # the start's evaluation, before the first step: a failure there is one line, exit 2, and the old state kept
    assert train.main(tiny_args(warm_cache, tmp_path / "run", "--dtype", "bfloat16", "--sampling", "fast")) == 2
    (enabled, dtype, loop), *more = seen
    assert (enabled, dtype, more) == (True, torch.bfloat16, [])
    assert loop.__qualname__.startswith("static_loop"), loop  # --sampling fast: decoding.py's loop, as training


# --- the memory defaults: --micro-batch and --sample-rows on CUDA (engine/policy.py's formulas) -------------------

GIB = 2**30
# Qwen2.5-0.5B's shape (the benchmark's): H = 896, I = 4864, 24 layers, 14 heads of 64, 2 KV heads, V = 151936, tied.
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
# Its parameters by hand: the embedding (the head, tied) V H = 136,134,656; a layer q 896^2 + 896, k and v 896 x 128 +
# 128 each, o 896^2, the MLP 3 x 896 x 4864, two norms 2 x 896: 14,912,384, x 24; the final norm 896.
QWEN_PARAMS = 151936 * 896 + 24 * (2 * (896 * 896) + 896 + 2 * (896 * 128 + 128) + 3 * 896 * 4864 + 2 * 896) + 896
QWEN_MATRICES = QWEN_PARAMS - 24 * (896 + 2 * 128) - (24 * 2 * 896 + 896)  # without the biases and norms
PER_TOKEN = 24 * (2 * (10 * 896 + 4 * 4864) + 16 * 896)  # bf16 matmuls: 1,708,032 bytes a token
HEAD = 4 * 1024 * 151936 * 4 + 4 * 151936 * 896  # 4 (1024, V) float32 blocks and grad_w
KV_ROW = 2 * 24 * 2 * 64 * 384 * 2  # a row's bf16 KV cache at 128 + 256 tokens: 4,718,592 bytes
SAMPLE_ROW = KV_ROW + 8 * 151936 * 4  # and 8 float32 vocabulary rows of the chain: 9,580,544 bytes


class FakeParam:  # a parameter as the sizing reads one: on a CUDA device, no gradient yet
    def __init__(self, numel, dtype=torch.float32, dim=2):
        self.device, self.dtype, self.requires_grad, self.grad = torch.device("cuda"), dtype, True, None
        self._n, self._dim = numel, dim

    def numel(self):
        return self._n

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def dim(self):
        return self._dim


class OnCuda:  # a model as auto_micro_batch and auto_sample_rows read one: its config, parameters on a CUDA device
    def __init__(self, dtype=torch.float32, params=(QWEN_MATRICES, QWEN_PARAMS - QWEN_MATRICES)):
        from types import SimpleNamespace

        self.config = SimpleNamespace(**QWEN_05B)
        self.params = [FakeParam(params[0], dtype), FakeParam(params[1], dtype, dim=1)]

    def parameters(self):
        return iter(self.params)


def fake_cuda(monkeypatch, free, total, reserved=0, allocated=0, fraction=1.0):
    """The driver and the caching allocator as the sizing reads them; returns the dict to change them by."""
    from engine import policy

    state = dict(free=free, total=total, reserved=reserved, allocated=allocated, fraction=fraction)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: state["allocated"])
    monkeypatch.setattr(policy, "memory_fraction", lambda device: state["fraction"])
    monkeypatch.setattr(policy, "_MICRO_BATCHES", {})
    monkeypatch.setattr(policy, "_SAMPLE_ROWS", {})
    return state


def test_the_memory_rules_of_thumb_are_the_formulas_written_beside_them():
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine import policy

    qwen = SimpleNamespace(**QWEN_05B)
    assert QWEN_PARAMS == 494_032_768 and PER_TOKEN == 1_708_032
    assert policy.activation_bytes_per_token(qwen, False, torch.bfloat16) == PER_TOKEN
    # float32 matmuls: 4 bytes where bf16's are 2; the residual stream is float32 either way.
    assert policy.activation_bytes_per_token(qwen, False, torch.float32) == 24 * (4 * (10 * 896 + 4 * 4864) + 16 * 896)
    assert policy.activation_bytes_per_token(qwen, True, torch.bfloat16) == 4 * 896 * 24 + PER_TOKEN // 24
    assert policy.head_bytes(qwen) == HEAD
    # The KV cache in the run's dtype: a float32 run keeps float32 keys and values, twice bf16's (it was taken as bf16).
    assert policy.kv_bytes_per_row(qwen, 384, torch.bfloat16) == KV_ROW == 4_718_592
    assert policy.kv_bytes_per_row(qwen, 384, torch.float32) == 2 * KV_ROW
    assert policy.sample_bytes_per_row(qwen, 384, torch.float32) == 2 * KV_ROW + 8 * 151936 * 4
    # What the first update still allocates, read off a real (meta-device) Qwen2: 4-byte gradients and 8 bytes of
    # moments for each float32 parameter, and bf16 copies of its matrices under autocast.
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B))
    assert sum(p.numel() for p in model.parameters()) == QWEN_PARAMS
    assert policy.pending_bytes(model, torch.bfloat16) == 12 * QWEN_PARAMS + 2 * QWEN_MATRICES
    assert policy.pending_bytes(model, None) == 12 * QWEN_PARAMS
    for p in model.parameters():  # after the first backward the gradients and moments are allocated: none pending
        p.grad = torch.empty_like(p)
    assert policy.pending_bytes(model, None) == 0


def test_the_memory_the_process_may_use_counts_the_allocators_cache_and_the_per_process_cap():
    from engine.policy import memory_available

    # The driver counts PyTorch's cached blocks as taken; they are the process's to reuse.
    assert memory_available(free=40 * GIB, total=141 * GIB, reserved=60 * GIB, allocated=10 * GIB) == 90 * GIB
    # Capped at 40 GiB of 141 (set_per_process_memory_fraction(40 / 141)): the cap binds, less what is allocated,
    # however much the device has free.
    capped = dict(total=141 * GIB, fraction=40 / 141)
    assert memory_available(free=120 * GIB, reserved=12 * GIB, allocated=10 * GIB, **capped) == 30 * GIB
    # Another process holding most of the device: its free memory binds, under the cap.
    assert memory_available(free=5 * GIB, reserved=12 * GIB, allocated=10 * GIB, **capped) == 7 * GIB


def test_a_memory_cap_sets_the_per_process_fraction_and_is_read_back_where_torch_cannot(monkeypatch):
    # bench --memory-cap-gb 40 on a 141 GiB device: the fraction 40 / 141; torch < 2.7 has no getter, so the cap
    # is remembered by engine.policy; a device smaller than the cap is not capped (fraction 1).
    from types import SimpleNamespace

    from engine import policy

    set_to = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: set_to.update({i: f}))
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    monkeypatch.setattr(policy, "_FRACTIONS", {})
    assert policy.cap_memory("cuda:0", 40) == set_to[0] == 40 / 141
    assert policy.memory_fraction("cuda:0") == 40 / 141
    assert policy.cap_memory("cuda:0", 200) == set_to[0] == 1.0
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.25, raising=False)
    assert policy.memory_fraction("cuda:0") == 0.25  # torch's own reading wins where it has one


@pytest.mark.parametrize(
    "gib, drawn_rows, rows, micro_batch",
    [
        (24, 512, 512, 8),
        (24, 2048, 512, 8),
        (40, 512, 512, 16),
        (40, 2048, 1024, 16),
        (80, 512, 512, 32),
        (80, 2048, 2048, 32),
    ],
)
def test_the_memory_defaults_fit_a_24_40_and_80_gb_device(monkeypatch, gib, drawn_rows, rows, micro_batch):
    # The benchmark's first step (Qwen2.5-0.5B shape, bf16 autocast, float32 weights, 64 x 8 rows of 128 + 256, beta
    # > 0) on a device of `gib` GiB, or a bigger one capped at it: the weights and pi_ref allocated (8 bytes a
    # parameter), the refresh samples `drawn_rows` rows (v = 1: 512, v = 4: 2048), its static decoder keeps
    # the KV cache and a bf16 copy of the matrices, then the update is sized from what is left.
    # By hand at 40 GiB and v = 1: F = 40 GiB - 3.95 GB = 38.99 GB; U = 0.85 F - pending 6.92 GB = 26.22 GB; half of
    # it holds 26.22e9 / 2 // 9,580,544 = 1368 rows: the 512. Then F = 40 GiB - 3.95 - 512 x 4.72 MB - 0.99 GB =
    # 35.59 GB; U = 0.85 F - 6.92 GB = 23.33 GB; less the head's 3.03 GB, 20.30 GB holds 20.30e9 // (384 x 1,708,032)
    # = 30 rows: the micro-batch is 16, the largest divisor of 512 within. At 80 GiB memory would hold more, and the
    # ceiling of 16,384 tokens a micro-batch (42 rows of 384) binds: 32.
    from engine import policy

    total = 141 * GIB
    weights = 2 * 4 * QWEN_PARAMS  # pi_theta and pi_ref, float32
    state = fake_cuda(monkeypatch, free=total - weights, total=total, reserved=weights, allocated=weights)
    state["fraction"] = gib * GIB / total
    model, pending = OnCuda(), 12 * QWEN_PARAMS + 2 * QWEN_MATRICES
    available = policy.available_bytes("cuda")
    assert available == gib * GIB - weights
    # At most 606 (24 GiB) or 1368 (40 GiB) rows a call fit; the 2048 rows go in equal calls (policy.balanced_rows).
    assert policy.auto_sample_rows(model, drawn_rows, 384, torch.bfloat16) == rows
    assert weights + rows * SAMPLE_ROW <= weights + policy.SAMPLE_SHARE * (0.85 * available - pending)
    # What sampling left: its KV cache and bf16 matrices stay with the static decoder; the chain's blocks are cached.
    kept = rows * KV_ROW + 2 * QWEN_MATRICES
    reserved = weights + rows * SAMPLE_ROW + 2 * QWEN_MATRICES
    state.update(free=total - reserved, reserved=reserved, allocated=weights + kept)
    assert policy.auto_micro_batch(model, 512, 384, False, torch.bfloat16) == micro_batch
    peak = weights + kept + pending + micro_batch * 384 * PER_TOKEN + HEAD  # the update's, by the rules of thumb
    assert peak <= gib * GIB - 0.15 * (gib * GIB - weights - kept)  # the headroom is left over
    if 2 * micro_batch * 384 <= policy.MICRO_BATCH_TOKENS:  # memory bound: the next divisor would not have fitted
        assert weights + kept + pending + 2 * micro_batch * 384 * PER_TOKEN + HEAD > gib * GIB - 0.15 * (
            gib * GIB - weights - kept
        )


def test_the_default_micro_batch_is_the_largest_divisor_whose_activations_fit():
    from types import SimpleNamespace

    from engine.policy import auto_micro_batch, micro_batch_fitting

    qwen = SimpleNamespace(**QWEN_05B)
    # 512 rows of 384 tokens with 20 GB available and nothing pending: 0.85 x 20e9 - HEAD = 13.97e9 holds 21 rows;
    # the largest divisor is 16.
    assert (17 * 10**9 - HEAD) // (384 * PER_TOKEN) == 21
    assert micro_batch_fitting(qwen, 512, 384, False, 20 * 10**9, torch.bfloat16) == 16
    # float32 matmuls keep more a token (3,072,000 bytes): 13.97e9 // (384 x 3,072,000) = 11 rows, so 8.
    assert micro_batch_fitting(qwen, 512, 384, False, 20 * 10**9, torch.float32) == 8
    # With 100 GB, 124 rows would fit; the ceiling of 16,384 tokens (42 rows of 384) binds: 32. Checkpointing too.
    assert (85 * 10**9 - HEAD) // (384 * PER_TOKEN) == 124 and 16_384 // 384 == 42
    assert micro_batch_fitting(qwen, 512, 384, False, 100 * 10**9, torch.bfloat16) == 32
    assert micro_batch_fitting(qwen, 512, 384, True, 100 * 10**9, torch.bfloat16) == 32
    assert micro_batch_fitting(qwen, 512, 128, False, 100 * 10**9, torch.bfloat16) == 128  # 16,384 / 128 rows
    assert micro_batch_fitting(qwen, 512, 384, False, 10**6, torch.bfloat16) == 1  # never 0
    # On a CPU the whole batch, as the shipped runs were made.
    assert auto_micro_batch(torch.nn.Linear(2, 2), 128, 40, False) == 128


def test_the_default_micro_batch_counts_the_allocators_cache_and_stays_the_same_for_the_same_shapes(monkeypatch):
    # On CUDA the driver counts PyTorch's cached blocks as taken: after a first step it reports less free memory,
    # though the cache is free to reuse. The choice counts that cache, and is remembered per shape.
    from engine import policy

    model = OnCuda(params=(1, 1))  # a negligible pending state: the hand-computed case above
    driver = fake_cuda(monkeypatch, free=100 * 10**9, total=140 * 10**9)
    assert policy.available_bytes("cuda") == 100 * 10**9
    first = policy.auto_micro_batch(model, 512, 384, False, torch.bfloat16)
    assert first == 32  # as the hand-computed case above, from 100 GB
    driver.update(free=40 * 10**9, reserved=60 * 10**9, allocated=0)  # the first step's blocks, cached and unused
    assert policy.available_bytes("cuda") == 100 * 10**9  # the cache counts as available
    driver.update(free=10**9, reserved=0, allocated=0)  # whatever the memory reads later, the same shapes split alike
    assert policy.auto_micro_batch(model, 512, 384, False, torch.bfloat16) == first
    assert policy.auto_micro_batch(model, 512, 128, False, torch.bfloat16) != first  # another shape: sized afresh


def test_the_default_sample_rows_take_the_whole_period_where_it_fits_and_count_a_float32_cache_at_4_bytes(monkeypatch):
    # A stale sampler batches its period: on a CPU all v x B x G rows in one call; on CUDA as many as half of what the
    # defaults may plan on holds. 100 GB available, nothing pending: 0.5 x 85e9 // 9,580,544 = 4436 rows in bf16; a
    # float32 run's KV cache takes 4 bytes a value, so fewer: 0.5 x 85e9 // (2 x 4,718,592 + 4,861,952) = 2972.
    from types import SimpleNamespace

    from engine import policy

    qwen = SimpleNamespace(**QWEN_05B)
    assert SAMPLE_ROW == 9_580_544
    assert policy.sample_rows_fitting(qwen, 384, 100 * 10**9, torch.bfloat16) == 425 * 10**8 // SAMPLE_ROW == 4436
    assert policy.sample_rows_fitting(qwen, 384, 100 * 10**9, torch.float32) == 425 * 10**8 // 14_299_136 == 2972
    assert policy.sample_rows_fitting(qwen, 384, 10**6, torch.bfloat16) == 1  # never 0
    assert policy.auto_sample_rows(torch.nn.Linear(2, 2), 2048, 384) == 2048  # a CPU: the whole period
    # Through auto_sample_rows: --dtype float32 (no autocast, float32 weights) sizes a float32 cache.
    fake_cuda(monkeypatch, free=100 * 10**9, total=140 * 10**9)
    model = OnCuda(params=(1, 1))
    # The calls made equal (policy.balanced_rows): 8192 rows at most 2972 a call are 3 calls of 2731; at most 4436, 2
    # calls of 4096. Equal calls share one static decoder (engine/memory.py counts each kept one).
    assert policy.auto_sample_rows(model, 8192, 384, None) == 2731
    assert policy.auto_sample_rows(model, 8192, 384, torch.bfloat16) == 4096
    assert policy.auto_sample_rows(model, 2048, 384, torch.bfloat16) == 2048  # a v = 4 period in one call
