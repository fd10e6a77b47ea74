"""The GRPO objective in torch: sampled-token logprobs, the clipped per-token loss, aggregation.

Names follow TRL's ``GRPOConfig`` (``epsilon_low``/``epsilon_high``, ``beta``, ``loss_type``)
so a job configured for TRL means the same thing here. Every aggregation is a weighted sum of
per-token losses whose weights depend only on the sequence's own length and on step-wide totals;
that is what lets the trainer split a job's step into micro-batches and still compute exactly the
loss of the whole step (pass the step totals, not the micro-batch's).
"""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


def per_token_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, advantages: torch.Tensor,
                   epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                   ref_logp: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """PPO-clip surrogate per token, negated (a loss), plus ``beta`` times the k3 KL to the reference.

    ``logp``/``old_logp``/``ref_logp`` are [S, T] (or any shape) token logprobs; ``advantages`` is
    one value per sequence, [S], broadcast over the tokens. ``old_logp=None`` means on-policy:
    the ratio is exactly 1 in value but keeps the gradient of ``logp``. ``epsilon_*`` and ``beta``
    are floats, or tensors of per-token settings shaped like ``logp`` (tokens of several jobs in
    one flat vector, as the graphed trainer computes them); a ``beta`` tensor always adds the KL
    term (a token without one gives it beta 0 and ``ref_logp`` equal to ``logp``).
    """
    if old_logp is None:
        old_logp = logp.detach()
    adv = advantages.reshape(advantages.shape + (1,) * (logp.dim() - advantages.dim()))
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    # The min of the two surrogates is a pessimistic bound: a step that would move the ratio past
    # the trust region earns no further gain, so one batch cannot move the policy too far.
    loss = -torch.min(ratio * adv, clipped * adv)
    if isinstance(beta, torch.Tensor) or beta != 0.0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} needs ref_logp")
        # k3 estimator (Schulman): unbiased for KL(pi || ref), always >= 0, low variance.
        log_ref_ratio = ref_logp - logp
        loss = loss + beta * (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0)
    return loss


def loss_token_weights(mask: torch.Tensor, loss_type: LossType = "grpo", *,
                       num_seqs: int | None = None, num_tokens: int | None = None,
                       max_completion_length: int | None = None) -> torch.Tensor:
    """Weight of each token of [S, T] ``mask`` in the job's loss (zero where the mask is 0).

    grpo: mean over each sequence's tokens, then mean over sequences -> 1 / (len_s * num_seqs).
    bnpo, dapo: sum over all tokens / number of tokens -> 1 / num_tokens (dapo normalises over
    the whole batch across processes in TRL; within one job that is the same as bnpo).
    dr_grpo: sum / (num_seqs * max_completion_length), a constant, so long answers are not
    down-weighted per token.

    ``num_seqs``, ``num_tokens`` default to this mask's counts and ``max_completion_length`` to its
    longest sequence; pass the whole step's values when ``mask`` is one micro-batch of it.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} must be one of {LOSS_TYPES}")
    m = mask.to(torch.float64)
    lengths = m.sum(dim=-1, keepdim=True)
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    if loss_type == "grpo":
        w = m / (lengths.clamp(min=1.0) * num_seqs)
    elif loss_type in ("bnpo", "dapo"):
        num_tokens = int(m.sum().item()) if num_tokens is None else num_tokens
        w = m / max(num_tokens, 1)
    else:
        if max_completion_length is None:
            max_completion_length = int(lengths.max().item()) if lengths.numel() else 1
        w = m / (num_seqs * max(max_completion_length, 1))
    return w


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType = "grpo", *,
                   num_seqs: int | None = None, num_tokens: int | None = None,
                   max_completion_length: int | None = None) -> torch.Tensor:
    """The job's scalar loss from [S, T] per-token losses (see ``loss_token_weights``)."""
    w = loss_token_weights(mask, loss_type, num_seqs=num_seqs, num_tokens=num_tokens,
                           max_completion_length=max_completion_length).to(per_token.dtype)
    # where(), not multiply: a NaN at a masked-out position (padding) must not poison the sum.
    return torch.where(mask.bool(), per_token * w, torch.zeros_like(per_token)).sum()


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target], chunk by chunk, never holding [N, vocab] logits.

    The gradient w.r.t. hidden, weight[target] - softmax @ weight, is computed in the forward
    while the chunk's logits exist and is saved ([N, d], small). Backward is then one multiply:
    no logits recomputation (checkpointing would redo the vocab matmul) and no [N, V] tensor kept.
    The weight (frozen lm_head) gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens):
        want_grad = ctx.needs_input_grad[0]
        # Softmax in at least fp32: bf16 logits lose the small probabilities' mass.
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if want_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            t = targets[start:end]
            logits = (hidden[start:end] @ weight.T).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            out[start:end] = logits.gather(1, t[:, None]).squeeze(1) - lse
            if want_grad:
                probs = logits.sub_(lse[:, None]).exp_()  # in place: the chunk's logits are done
                expected = (probs.to(weight.dtype) @ weight).to(acc)
                grad_hidden[start:end] = weight[t].to(acc) - expected
        ctx.save_for_backward(grad_hidden if want_grad else None)
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            return None, None, None, None
        return (grad_out[:, None] * grad_hidden).to(ctx.hidden_dtype), None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   chunk_tokens: int = 2048) -> torch.Tensor:
    """Logprob of each target token, [N] in fp32 (fp64 for fp64 hidden), from hidden states [N, d] and a frozen output
    embedding [V, d], with peak memory chunk_tokens * V instead of N * V."""
    if weight.requires_grad:
        raise ValueError("token_logprobs gives no gradient to the output embedding; freeze it")
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, chunk_tokens)
