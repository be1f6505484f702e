"""pi_ref's and MIS's no-grad forwards give the log-probs of a plain eval forward whatever mode the update left the
policy in (issue 45, point 6): with gradient checkpointing the update leaves it in train mode, where some
transformers versions drop the KV cache the chunked log-prob's shared-prompt pass uses (a silently wrong KL)."""

import pytest
import torch

import train
from config import Config, resolve
from conftest import TEST_WARMUP, needs
from engine import tiny
from engine.policy import make_models
from logprobs import token_logprobs
from problems.tasks import Problem, encode_prompts
from rollout import generate

pytestmark = pytest.mark.model


def stale_batch(model, tok, group_size=4) -> tuple[train.Batch, object]:
    """Two prompts x G completions (a group shares its prompt: the chunked pass runs it once, with a KV cache),
    and a stale log alpha (the sampler's, moved by noise) so that MIS drops some tokens."""
    ids, mask = encode_prompts(tok, [Problem("12+7=", "19"), Problem("40-3=", "37")], "cpu")
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    ro = generate(model, ids, mask, group_size=group_size, max_new_tokens=6, temperature=1.0, **kw)
    noise = 0.3 * torch.randn(ro.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    n = ro.completion_ids.shape[0]
    batch = train.Batch(
        input_ids=ro.input_ids,
        attention_mask=ro.attention_mask,
        completion_mask=ro.completion_mask,
        loss_mask=ro.completion_mask,
        advantages=torch.tensor([(-1.0) ** i for i in range(n)]),
        alpha_logp=(ro.sampler_logp + noise) * ro.completion_mask,
    )
    return batch, ro


def test_pi_ref_and_mis_forwards_run_in_eval_mode_and_equal_a_plain_eval_forward(warm_cache):
    needs("peft", "lora")
    cfg = resolve(
        Config(
            gradient_checkpointing=True,
            lora_rank=4,
            lora_alpha=8.0,
            beta=0.04,
            offpolicy_steps=2,
            is_mask=1.2,
            lr=1e-2,
            out="/tmp/unused",
        )
    )
    base, tok = tiny.load_tiny(warm_cache, TEST_WARMUP, log=lambda m: None)
    models = make_models(cfg, base)
    batch, ro = stale_batch(models.policy, tok)
    modes = []  # the decoder's mode at every forward
    decoder = models.policy.get_base_model().get_decoder()
    hook = decoder.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    train.update(cfg, models.policy, models.opt, batch, None)  # MIS on a stale step: a no-grad pass for pi_k first
    assert models.policy.training  # checkpointing: the update leaves the policy in train mode
    assert modes[0] is False and True in modes  # MIS's pass in eval mode, the update's in train mode
    modes.clear()
    ref_logp = train.ref_logprobs(cfg, models, ro, k=1)  # pi_ref: the policy with its adapter off
    hook.remove()
    assert modes and not any(modes) and models.policy.training  # eval for the pass, train mode given back
    models.policy.eval()
    with torch.no_grad(), models.policy.disable_adapter():
        plain = token_logprobs(models.policy, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)
    assert torch.allclose(ref_logp, plain, atol=1e-5), (ref_logp - plain).abs().max()
