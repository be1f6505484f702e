"""[A]'s clip acting, on one token of a real run: rho, rho', the interval and which side of the min() won.

    python -m studies.clip_example --offpolicy-steps 4 --inner-steps 4 --steps 40 --out runs/clip-example

It runs train.py with the flags given (any of them) and watches every loss the run computes (variants.Recipe.loss). With
one inner step the gradient is taken where rho = rho', inside [A]'s interval, so the clip never acts; from the
second inner step of a stale step on, pi_theta has moved away from pi_k and a token can leave its interval. The
stalest such token is printed as a worked example, with what PPO's interval around 1 would have done to it; then
how many tokens each interval clipped over the run, and the clip fractions of the run's metrics.jsonl.
docs/design.md, "The clip acting", shows its output.
"""

import json
import math
import sys
from pathlib import Path

import torch

import train
from objective import clip_interval
from variants import Recipe


def first_clipped_token(cfg, logp, alpha_logp, pi_k_logp, advantages, loss_mask) -> dict | None:
    """The token (row, t) of a micro-batch whose gradient [A]'s clip removed, with every figure of its surrogate:
    of those, the one whose rho' is furthest from 1 (the stalest), where [A]'s interval differs most from PPO's;
    None when the clip acted on no token whose sampler was stale."""
    if cfg.loss != "grpo" or cfg.clip_center != "pi_k":
        return None
    with torch.no_grad():
        rho = torch.exp(logp.detach() - alpha_logp)  # (n, T) pi_theta / alpha
        rho_prime = torch.exp(pi_k_logp - alpha_logp)  # (n, T) pi_k / alpha
        eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        lo, hi = clip_interval(rho_prime, "pi_k", cfg.clip_eps, eps_high)
        A = advantages[:, None].expand_as(rho)
        acted = ((rho > hi) & (A > 0) | (rho < lo) & (A < 0)) & (loss_mask > 0) & (rho_prime != 1.0)
        if not acted.any():
            return None
        staleness = torch.where(acted, (rho_prime - 1.0).abs(), -1.0)
        i, t = divmod(int(staleness.argmax()), rho.shape[1])
        return {
            "row": i,
            "t": t,
            "A": A[i, t].item(),
            "log_alpha": alpha_logp[i, t].item(),
            "log_pi_k": pi_k_logp[i, t].item(),
            "log_pi_theta": logp[i, t].item(),
            "rho_prime": rho_prime[i, t].item(),
            "rho": rho[i, t].item(),
            "lo": lo[i, t].item(),
            "hi": hi[i, t].item(),
            "eps": (cfg.clip_eps, eps_high),
        }


def clip_counts(cfg, logp, alpha_logp, pi_k_logp, advantages, loss_mask) -> torch.Tensor:
    """(tokens, clipped by [A]'s interval, clipped by PPO's interval around 1, clipped by PPO's only) over the loss's
    tokens of a micro-batch: what centring the interval on rho' changes."""
    with torch.no_grad():
        rho = torch.exp(logp.detach() - alpha_logp)  # (n, T)
        rho_prime = torch.exp(pi_k_logp - alpha_logp)  # (n, T)
        eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        A = advantages[:, None].expand_as(rho)
        on = loss_mask > 0

        def acts(center):
            lo, hi = clip_interval(rho_prime, center, cfg.clip_eps, eps_high)
            return ((rho > hi) & (A > 0) | (rho < lo) & (A < 0)) & on

        ours, ppo = acts("pi_k"), acts("alpha")
        return torch.stack([on.sum(), ours.sum(), ppo.sum(), (ppo & ~ours).sum()]).double()


def explain(x: dict, step: int) -> str:
    """The worked example, in [A]'s notation."""
    A, rho, rho_p, lo, hi = x["A"], x["rho"], x["rho_prime"], x["lo"], x["hi"]
    side = "above hi, and A > 0" if rho > hi else "below lo, and A < 0"
    bound = hi if rho > hi else lo
    ppo_lo, ppo_hi = 1 - x["eps"][0], 1 + x["eps"][1]
    ppo = "clipped too" if (rho > ppo_hi and A > 0) or (rho < ppo_lo and A < 0) else "not clipped"
    lines = [
        f"step {step} (its batch sampled by an older alpha), a later inner step: row {x['row']}, token {x['t']}",
        f"  A = {A:+.4f}",
        f"  log alpha = {x['log_alpha']:.4f}, log pi_k = {x['log_pi_k']:.4f}, log pi_theta = {x['log_pi_theta']:.4f}",
        f"  rho' = pi_k / alpha = exp({x['log_pi_k']:.4f} - ({x['log_alpha']:.4f})) = {rho_p:.4f}",
        f"  rho  = pi_theta / alpha = {rho:.4f}",
        f"  [A]'s interval [max(rho' - eps_low, 0), rho' + eps_high] = [{lo:.4f}, {hi:.4f}]",
        f"  rho is {side}: min(rho A, clip(rho) A) = min({rho * A:+.4f}, {bound * A:+.4f})"
        f" = {min(rho * A, bound * A):+.4f},",
        "  the clipped branch, a constant: this token's gradient is 0.",
        f"  PPO's interval around 1, [{ppo_lo:.2f}, {ppo_hi:.2f}], would have: {ppo} (rho = {rho:.4f}).",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    found, calls, counts = {}, {"k": -1}, torch.zeros(4, dtype=torch.float64)
    real_step, real_loss = train.grpo_step, Recipe.loss

    def step_spy(cfg, models, tokenizer, k, *a, **kw):
        calls.update(k=k, cfg=cfg)
        return real_step(cfg, models, tokenizer, k, *a, **kw)

    def loss_spy(recipe, x):
        cfg, tensors = calls["cfg"], (x.logp, x.alpha_logp, x.pi_k_logp, x.advantages, x.loss_mask)
        if cfg.loss == "grpo":
            counts.add_(clip_counts(cfg, *tensors))
        if not found:
            token = first_clipped_token(cfg, *tensors)
            if token is not None:
                found.update(token, step=calls["k"])
        return real_loss(recipe, x)

    train.grpo_step, Recipe.loss = step_spy, loss_spy
    try:
        status = train.main(argv)
    finally:
        train.grpo_step, Recipe.loss = real_step, real_loss
    if status != 0:
        return status
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if found:
        print(explain(found, found["step"]))
    else:
        print("the clip acted on no token of this run (one inner step, or a policy that barely moved)")
    n, ours, ppo, ppo_only = counts.tolist()
    print(
        f"over the run's {n:.0f} loss tokens (every inner step): [A]'s interval clipped {ours / n:.4f} of them;\n"
        f"PPO's interval around 1 would have clipped {ppo / n:.4f}, {ppo_only / n:.4f} being tokens [A]'s keeps"
    )
    if out is not None:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        clipped = [r for r in rows if r.get("clip_low", 0) + r.get("clip_high", 0) > 0]
        frac = [r.get("clip_low", 0) + r.get("clip_high", 0) for r in rows if "clip_low" in r]
        mean = sum(frac) / max(len(frac), 1)
        print(
            f"clip fraction (clip_low + clip_high, per step): non-zero on {len(clipped)} of {len(rows)} steps, "
            f"mean {mean:.4f}, max {max(frac, default=math.nan):.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
