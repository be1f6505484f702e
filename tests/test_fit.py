"""Fitting the model in memory (policy.fit_policy, policy.BF16AdamW): gradient checkpointing gives the plain
gradient and really recomputes, bfloat16 weights round without bias and learn, LoRA trains the adapter alone."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train
from config import Config, resolve
from conftest import TEST_WARMUP, needs
from engine import policy
from engine.policy import make_models
from problems.tasks import Problem, encode_prompts
from rollout import generate

pytestmark = pytest.mark.model  # trains or decodes a model: CI runs these again under plain kernels


def needs_peft():
    """LoRA's tests need peft (the [lora] extra)."""
    needs("peft", "lora")


def cfg_for(**kw) -> Config:
    base = dict(max_grad_norm=1e9, temperature=1.0, group_size=2, prompts_per_step=2, out="/tmp/unused", lr=0.0)
    return resolve(Config(**{**base, **kw}))


def sampled_batch(model, tok, problems, tokens=6) -> train.Batch:
    """One completion per problem (distinct prompts: the log-probs run one plain pass), advantages +1, -1, ..."""
    ids, mask = encode_prompts(tok, problems, "cpu")
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = generate(
        model,
        ids,
        mask,
        group_size=1,
        max_new_tokens=tokens,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        **special,
    )
    adv = torch.tensor([(-1.0) ** i for i in range(len(problems))])  # (N,)
    return train.Batch(
        input_ids=ro.input_ids,
        attention_mask=ro.attention_mask,
        completion_mask=ro.completion_mask,
        loss_mask=ro.completion_mask,
        advantages=adv,
        alpha_logp=None,  # a refresh step: alpha is pi_k
    )


def gradient_and_calls(cfg: Config, model, batch: train.Batch) -> tuple[torch.Tensor, int]:
    """train.update's gradient (lr 0: the weights stay) and how often the decoder layers' MLPs ran (counted in
    their forward itself: torch runs no module hooks when checkpointing recomputes a layer)."""
    models = make_models(cfg, model)
    calls = []
    for name, mlp in models.policy.named_modules():
        if name.endswith(".mlp"):
            mlp.forward = lambda *a, f=mlp.forward, **k: calls.append(1) or f(*a, **k)
    train.update(cfg, models.policy, models.opt, batch, None)
    return torch.cat([p.grad.flatten() for p in models.policy.parameters() if p.grad is not None]), len(calls)


@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm2", marks=pytest.mark.real_model)])
def test_gradient_checkpointing_recomputes_and_gives_the_plain_gradient(which, request, tok):
    if which == "smollm2":
        needs("gguf", "real")
        model, tokenizer = request.getfixturevalue("smollm2")
        problems = [
            Problem("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
            Problem("A box holds 6 pens. How many pens are in 2 boxes?", "12"),
        ]
    else:
        model, tokenizer = request.getfixturevalue("model"), tok
        problems = [Problem("12+7=", "19"), Problem("40-3=", "37"), Problem("5*6=", "30")]
    batch = sampled_batch(model, tokenizer, problems)
    n_layers = model.config.num_hidden_layers
    plain, calls_plain = gradient_and_calls(cfg_for(), copy.deepcopy(model), batch)
    ckpt, calls_ckpt = gradient_and_calls(cfg_for(gradient_checkpointing=True), copy.deepcopy(model), batch)
    assert calls_plain == n_layers and calls_ckpt == 2 * n_layers  # every layer ran again in the backward
    assert plain.abs().max() > 0 and (ckpt - plain).abs().max().item() <= 1e-6


def adamw_reference(w: torch.Tensor, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
    """torch's own AdamW (single-tensor path) in float32 from the same start, after len(grads) steps."""
    p = torch.nn.Parameter(w.float().clone())
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.01, foreach=False)
    for g in grads:
        p.grad = g.float()
        opt.step()
    return p.detach()


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above x in magnitude (equal where x is one)."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = torch.where(low == x, low, ((bits & -65536) + 65536).view(torch.float32))
    return low, high


def test_bf16_adamw_is_torch_adamw_then_an_unbiased_rounding_where_plain_adamw_loses_the_step():
    n = 200_000
    w0 = torch.full((n,), 0.0312, dtype=torch.bfloat16)  # spacing 2^-13 = 1.2e-4 here
    g = torch.full((n,), 0.5, dtype=torch.bfloat16)
    lr = 2e-5  # one AdamW step moves a weight by about lr: a sixth of its bfloat16 spacing
    ours = torch.nn.Parameter(w0.clone())
    opt = policy.BF16AdamW([ours], lr=lr, weight_decay=0.01, seed=3)
    ours.grad = g.clone()
    opt.step()
    exact = adamw_reference(w0, [g], lr)  # (n,) float32
    low, high = bf16_neighbours(exact)
    got = ours.detach().float()
    assert ((got == low) | (got == high)).all()  # one of the two neighbours, every element
    p_high = ((exact - low) / (high - low))[0].item()  # the chance of rounding away from zero
    assert abs((got == high).float().mean().item() - p_high) < 0.005  # 200k draws: the std is 0.001
    assert abs(got.mean().item() - exact.mean().item()) < 0.01 * (high - low)[0].item()  # E[w_new] = exact
    # torch's AdamW on the same bfloat16 weights rounds to nearest: the step is lost
    plain = torch.nn.Parameter(w0.clone())
    torch_opt = torch.optim.AdamW([plain], lr=lr, weight_decay=0.01)
    plain.grad = g.clone()
    torch_opt.step()
    assert torch.equal(plain.detach(), w0)
    assert opt.state[ours]["exp_avg"].dtype == torch.float32


def test_bf16_adamw_float32_parameters_are_exactly_torch_adamw_and_a_reload_keeps_float32_moments():
    torch.manual_seed(0)
    w = torch.randn(64)
    grads = [torch.randn(64) for _ in range(4)]
    p = torch.nn.Parameter(w.clone())
    opt = policy.BF16AdamW([p], lr=1e-2, weight_decay=0.01)
    for i, gr in enumerate(grads):
        p.grad = gr.clone()
        opt.step()
        if i == 1:  # reload mid-way into a fresh optimizer over a bfloat16 twin: the moments stay float32
            twin = torch.nn.Parameter(p.detach().to(torch.bfloat16))
            fresh = policy.BF16AdamW([twin], lr=1e-2, weight_decay=0.01)
            fresh.load_state_dict(opt.state_dict())
            assert fresh.state[twin]["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(fresh.state[twin]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert torch.equal(p.detach(), adamw_reference(w, grads, 1e-2))


def tiny_run(warm_cache, out, *extra, steps=6) -> dict:
    argv = [
        "--steps",
        str(steps),
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--eval-size",
        "100",
        "--eval-every",
        "0",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
    assert train.main(argv) == 0
    return json.loads((out / "summary.json").read_text())


def test_a_bf16_weights_run_learns_on_the_builtin_task(warm_cache, tmp_path):
    s = tiny_run(warm_cache, tmp_path / "bf16", "--param-dtype", "bfloat16", "--offpolicy-steps", "2", steps=120)
    assert s["eval_accuracy_end"] >= s["eval_accuracy_start"] + 0.05, s
    final = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}


LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--offpolicy-steps", "2"]


def test_lora_trains_the_adapter_alone_the_kl_starts_at_zero_and_final_holds_the_adapter(warm_cache, tmp_path):
    needs_peft()
    from peft import PeftModel

    from engine import tiny

    tiny_run(warm_cache, tmp_path / "lora", *LORA, "--beta", "0.04", "--lr", "1e-3", "--save-every", "3")
    rows = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # pi_ref is the base: the adapter starts at zero
    final = tmp_path / "lora" / "final"
    assert (final / "adapter_model.safetensors").exists() and not (final / "model.safetensors").exists()
    base, _ = tiny.load_tiny(warm_cache, TEST_WARMUP, log=lambda m: None)
    untouched = copy.deepcopy(base.state_dict())
    trained = PeftModel.from_pretrained(base, final)
    lora = {n for n, _ in trained.named_parameters() if "lora_" in n}
    assert lora and any(trained.state_dict()[n].abs().max() > 0 for n in lora if "lora_B" in n)
    merged = trained.merge_and_unload()  # docs/real-model.md's merge
    moved = [k for k in untouched if not torch.equal(untouched[k], merged.state_dict()[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)  # only adapted layers change, by B A
    ck = torch.load(next((tmp_path / "lora" / "checkpoints").glob("step-*.pt")), weights_only=True)
    assert ck["policy"].keys() and all("lora_" in k for k in ck["policy"])  # the checkpoint holds the adapter


def test_lora_base_weights_stay_bit_identical_and_only_the_adapter_reaches_the_optimizer(warm_cache):
    needs_peft()
    from engine import tiny

    cfg = cfg_for(lora_rank=4, lora_alpha=8.0, lr=1e-2, prompts_per_step=2, group_size=2)
    base, tok = tiny.load_tiny(warm_cache, TEST_WARMUP, log=lambda m: None)
    before = copy.deepcopy(base.state_dict())
    models = make_models(cfg, base)
    names = {id(p): n for n, p in models.policy.named_parameters()}
    assert all("lora_" in names[id(p)] for g in models.opt.param_groups for p in g["params"])
    batch = sampled_batch(models.policy, tok, [Problem("12+7=", "19"), Problem("40-3=", "37")])
    for _ in range(3):
        train.update(cfg, models.policy, models.opt, batch, None)
    after = models.policy.get_base_model().state_dict()
    base_keys = [k for k in after if "lora_" not in k]
    assert all(torch.equal(after[k], before[k.replace(".base_layer", "")]) for k in base_keys)
    assert any(after[k].abs().max() > 0 for k in after if "lora_B" in k)  # the adapter moved


def test_lora_resume_is_bit_identical(warm_cache, tmp_path):
    needs_peft()
    out = tmp_path / "run"
    tiny_run(warm_cache, out, *LORA, "--lr", "1e-3", "--save-every", "3", "--beta", "0.04")
    whole = load_file(out / "final" / "adapter_model.safetensors")
    shutil.rmtree(out / "final")
    (out / "checkpoints" / "step-00000006.pt").unlink()  # back to step 3: mid-run, and inside a refresh period (v = 2)
    assert train.main(["--resume", "--out", str(out), "--no-progress"]) == 0
    resumed = load_file(out / "final" / "adapter_model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize(
    "args, expect, extra",
    [
        (["--lora-alpha", "8"], "--lora-alpha 8.0: cannot act here", None),
        (["--lora-rank", "4", "--beta", "0.1", "--ref-refresh", "5"], "--ref-refresh needs full fine-tuning", None),
        (["--lora-rank", "4", "--lora-targets", "no_such_proj"], "--lora-targets no_such_proj", "peft"),
        (["--param-dtype", "float16"], "--param-dtype: unknown value 'float16'", None),
    ],
)
def test_the_levers_refuse_what_cannot_work_in_one_line(tmp_path, capsys, args, expect, extra):
    if extra == "peft":  # the adapter's own check runs inside peft: without it the run stops at its missing package
        needs_peft()
    assert train.main([*args, "--steps", "1", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    lines = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()  # after the loader's progress bar
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and expect in lines[-1], (args, lines[-3:])
