"""The GPU path's code, run on the CPU: bf16 autocast, the static-cache sampler, generators on another device,
out-of-memory, so that a lent GPU confirms these rather than discovers them (benchmarks/gpu_check.sh runs them
there too).

Each check is against something independent: float32 autograd of the textbook log-softmax for the gradients, the
plain sampling loop for the static-cache one, a patched torch function for the device of random calls.
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from logprobs import SelectedLogProb

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
    step.update calls loss.backward()."""
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
    """Every matrix product that runs inside the block: (op name, dtypes of its tensor inputs, their shapes)."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append(
                (func.overloadpacket.__name__, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
            )
        return func(*args, **(kwargs or {}))


def test_no_float32_matmul_of_vocabulary_size_runs_in_the_backward_under_autocast():
    hidden, weight, targets, coef = confident_head(2)
    v = weight.shape[0]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(**BF16):
        logp = chunked_logp(h, w, targets)
    with MatmulLog() as log:
        (logp * coef).sum().backward()
    vocab_sized = [c for c in log.calls if any(v in shape for shape in c[2])]
    assert len(vocab_sized) == 3 * 4, log.calls  # per chunk: the logits again, then d hidden and d weight
    assert all(d == torch.bfloat16 for _, dtypes, _ in vocab_sized for d in dtypes), vocab_sized


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
    from config import Config
    from step import compute_advantages

    patched = OtherDevice(monkeypatch)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # two groups of 4, one positive each
    cfg = Config(group_size=4, red="drop", reward_shuffle=True)
    advantages, valid = compute_advantages(cfg, rewards, torch.Generator().manual_seed(0))
    assert patched.calls == 3  # one shuffle, one drop per group
    assert valid.sum() == 4  # RED-Drop kept one positive and one negative per group
