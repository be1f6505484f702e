"""Group-relative advantages: GRPO's critic-free baseline ([A] eq. 1).

GRPO samples G completions per prompt and scores each one against its own group: the
group's mean reward is the baseline, the group's standard deviation the scale ([A] eq. 1,
after Shao et al. 2024):

    mean_g    = mean_i r_i                      over the G completions of prompt g (r_i: rewards)
    sigma_g^2 = mean_i (r_i - mean_g)^2         (population variance, not the unbiased one)
    A_i       = (r_i - mean_g) / sqrt(sigma_g^2 + guard)   (guard = 1e-6 against a zero std)

Groups whose rewards are all equal carry no learning signal (every A_i is 0). With
`mask_zero_std` they are marked invalid so that the caller drops their tokens from the loss
*and from its normaliser*; otherwise they would dilute the mean of the groups that do carry
signal ([A] Sec. 5 shows the masking matters).

[B] (Yao et al. 2025) shapes the same advantages (AsymRE, RED-Drop, RED-Weight): those are
variants/shaping.py's units, around this function.

Shapes: rewards, advantages and masks are (N,) with N = B*G, ordered group-major
(the G completions of prompt 0, then those of prompt 1, ...).

Deviations from the papers:
  1. Zero-std groups are detected by exact equality of their rewards (max == min), not by
     sigma < threshold: rewards from a verifier are exact, and a threshold would silently
     drop groups with small but real spreads.
"""

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    guard: float = 1e-6,
    mask_zero_std: bool = True,
    scale_std: bool = True,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages and the mask of groups that carry signal.

    Args:
        rewards: (N,) rewards, group-major, N divisible by `group_size`.
        group_size: G, completions per prompt.
        guard: added to the variance before the square root (1e-6; not the clip's eps).
        mask_zero_std: mark groups whose rewards are all equal as invalid.
        scale_std: divide by the group's standard deviation (GRPO); False for Dr. GRPO, and [B]'s OPMD
            and AsymRE (variants/).
        keep: optional (N,) bool mask of the samples that count (RED-Drop's, variants/shaping.py);
            the others get advantage 0, are invalid, and do not enter their group's statistics.

    Returns:
        advantages: (N,) float32; 0 for invalid or dropped samples.
        valid: (N,) bool; False for every completion of a zero-std group (when masking)
            and for dropped samples.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be (N,) with N divisible by group_size={group_size}, got {tuple(rewards.shape)}"
        )
    r = rewards.float().view(-1, group_size)  # (B, G)
    kept = torch.ones_like(r, dtype=torch.bool) if keep is None else keep.view(-1, group_size)  # (B, G)
    kept_f = kept.float()  # (B, G)
    n_kept = kept_f.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    mean = (r * kept_f).sum(dim=1, keepdim=True) / n_kept  # (B, 1) mean_g over kept samples
    var = ((r - mean) ** 2 * kept_f).sum(dim=1, keepdim=True) / n_kept  # (B, 1) sigma_g^2, population variance
    adv = r - mean  # (B, G)
    if scale_std:
        adv = adv / torch.sqrt(var + guard)  # (B, G)
    # A group is degenerate when all its kept rewards are equal: max == min over kept samples.
    r_max = torch.where(kept, r, torch.full_like(r, -float("inf"))).amax(dim=1, keepdim=True)  # (B, 1)
    r_min = torch.where(kept, r, torch.full_like(r, float("inf"))).amin(dim=1, keepdim=True)  # (B, 1)
    zero_std = r_max <= r_min  # (B, 1)
    valid = kept.clone()  # (B, G)
    if mask_zero_std:
        valid = valid & ~zero_std  # (B, G)
    adv = torch.where(valid, adv, torch.zeros_like(adv))  # (B, G)
    return adv.view(-1), valid.view(-1)
