"""The KL term to the reference policy: Schulman's three per-token estimators.

Owns: ``kl_estimate`` (k1, k2, k3 of KL(current || reference) from the two policies'
logprobs of the sampled tokens; ``workers.trainer.config.KlEstimator`` names them).
Knows nothing about where the logprobs come from (the reference's forward is
``workers.trainer.shard_roles``') nor how the term enters the loss or the reward.

With ``log_ratio = logprob - ref_logprob`` on tokens sampled from the current policy:

    k1 = log_ratio                      unbiased, high variance, can be negative
    k2 = log_ratio ** 2 / 2             biased, never negative
    k3 = exp(-log_ratio) + log_ratio - 1   unbiased, never negative, low variance

k3 is verl's ``low_var_kl``; like verl's it clamps ``-log_ratio`` to +-20 before ``exp``
and the estimate to +-10, so a token the reference finds impossible cannot give an
infinite term.
"""

from __future__ import annotations

import torch

from workers.trainer.config import KlEstimator

K3_LOG_RATIO_LIMIT = 20.0
"""k3's ``ref_logprob - logprob`` is clamped to +-this before ``exp``."""
K3_LIMIT = 10.0
"""k3's estimate is clamped to +-this."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                estimator: KlEstimator) -> torch.Tensor:
    """Per token, the ``estimator``'s estimate of KL(current || reference); gradient
    flows through ``logprobs`` (the reference's are constants)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    reverse = torch.clamp(-log_ratio, -K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)
    return torch.clamp(torch.exp(reverse) - reverse - 1.0, -K3_LIMIT, K3_LIMIT)
