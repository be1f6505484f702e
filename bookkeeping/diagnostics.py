"""What a step measures beside its loss: how far the sampler alpha is from pi_k, and whether sampling and
training see the same model. Neither changes the update."""

import torch


def drift_stats(alpha_logp: torch.Tensor, pi_k_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """How far the sampler alpha is from pi_k (the drift), as floats over loss_mask's tokens (y_t ~ alpha):

        mismatch_kl_k1   mean_t [ log alpha(y_t) - log pi_k(y_t) ]     KL(alpha || pi_k), k1
        mismatch_kl_k3   mean_t [ rho'_t - 1 - log rho'_t ]            the same KL, k3 (>= 0, lower variance)
        m2               mean_t (log rho'_t)^2                         the second moment M2PO bounds (the drift)
        rho_prime_mean, rho_prime_p50, rho_prime_p99, rho_prime_max    of rho'_t = pi_k(y_t) / alpha(y_t)

    They depend on alpha and pi_k only, not on pi_theta, so a step computes them once, on the whole step: quantiles
    of micro-batches do not combine (torch's quantiles take at most 2**24 = 16.7M tokens).
    """
    log_rho_prime = pi_k_logp.detach() - alpha_logp.detach()  # (N, T)
    counted = loss_mask > 0  # (N, T)
    rho_prime = torch.exp(log_rho_prime)  # (N, T)
    # Masked-out tokens become NaN, which nanquantile skips: no boolean indexing, so no device sync.
    rho_counted = rho_prime.masked_fill(~counted, float("nan")).flatten()  # (N*T,)
    rho_counted = rho_counted if rho_counted.dtype == torch.float64 else rho_counted.float()  # quantiles need fp32/64
    q = torch.tensor([0.5, 0.99], dtype=rho_counted.dtype, device=rho_counted.device)  # (2,)
    p50_p99 = torch.nanquantile(rho_counted, q) if rho_counted.numel() else torch.ones_like(q)  # (2,) linear interp.
    rho_max = rho_prime.masked_fill(~counted, float("-inf")).amax() if rho_prime.numel() else torch.ones(())

    def counted_sum(x):
        return torch.where(counted, x, torch.zeros_like(x)).sum()  # where(): an inf outside must not leak in

    # k1 and k3 of KL(alpha || pi_k) from tokens drawn from alpha: log(alpha / pi_k) = -log rho', and
    # pi_k/alpha - 1 - log(pi_k/alpha) = rho' - 1 - log rho' (>= 0).
    sums = {
        "tokens": counted.sum(),
        "kl_k1": counted_sum(-log_rho_prime),
        "kl_k3": counted_sum(rho_prime - 1.0 - log_rho_prime),
        "m2": counted_sum(log_rho_prime.square()),
        "rho_prime": counted_sum(rho_prime),
        "p50": p50_p99[0],
        "p99": p50_p99[1],
        "max": rho_max.to(rho_prime.dtype),
    }
    # One transfer to the host for all of them.
    host = dict(zip(sums, torch.stack([x.to(rho_prime.dtype) for x in sums.values()]).tolist()))
    n = host["tokens"]
    if n == 0:  # no token in the loss: no mismatch to report (rho' = 1, no KL)
        host.update(kl_k1=0.0, kl_k3=0.0, m2=0.0, rho_prime=1.0, p50=1.0, p99=1.0, max=1.0)
        n = 1
    return {
        "mismatch_kl_k1": host["kl_k1"] / n,
        "mismatch_kl_k3": host["kl_k3"] / n,
        "m2": host["m2"] / n,
        "rho_prime_mean": host["rho_prime"] / n,
        "rho_prime_p50": host["p50"],
        "rho_prime_p99": host["p99"],
        "rho_prime_max": host["max"],
    }


def sampler_mismatch(sampler_logp: torch.Tensor, forward_logp: torch.Tensor, on: torch.Tensor) -> dict:
    """{"sampler_mismatch": mean |log alpha while sampling - log alpha of a full forward|} over `on`'s tokens. A
    large value means sampling and training see different models (the KV cache, the fast path, autocast)."""
    gap = (sampler_logp - forward_logp).abs() * on  # (N, T)
    return {"sampler_mismatch": gap.sum().item() / max(on.sum().item(), 1)}
