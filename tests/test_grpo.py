"""GRPO maths: advantages (numpy core), the clipped per-token loss, loss_type normalisations,
and the chunked sampled-token logprobs, on hand-computed examples."""

import math
import subprocess
import sys

import numpy as np
import pytest

from nodus.grpo import group_advantages

torch = pytest.importorskip("torch")
from real.grpo_loss import aggregate_loss, loss_token_weights, per_token_loss, token_logprobs  # noqa: E402


# --- advantages ---------------------------------------------------------------------------------

def test_core_grpo_imports_without_torch():
    code = "import sys, nodus.grpo; assert 'torch' not in sys.modules, 'nodus.grpo pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_group_advantages_group_scaling():
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: mean 0.25, std 0.5
    adv = group_advantages([0, 1, 0, 1, 1, 0, 0, 0], group_size=4)
    s1, s2 = math.sqrt(1 / 3), 0.5
    expected = [-0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4)] * 2 + [0.75 / (s2 + 1e-4)] + [-0.25 / (s2 + 1e-4)] * 3
    np.testing.assert_allclose(adv, expected, rtol=1e-12)


def test_group_advantages_batch_and_none():
    rewards = [1.0, 3.0, 2.0, 6.0]
    batch_std = np.std(rewards, ddof=1)
    np.testing.assert_allclose(group_advantages(rewards, 2, "batch"),
                               np.array([-1, 1, -2, 2]) / (batch_std + 1e-4), rtol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards, 2, "none"), [-1, 1, -2, 2])


def test_group_advantages_equal_rewards_give_zero():
    assert np.all(group_advantages([1, 1, 1, 0.5, 0.5, 0.5], 3) == 0)
    assert np.all(group_advantages([2.0, 5.0], 1) == 0)  # a group of one has no baseline to beat


@pytest.mark.parametrize("kwargs, match", [
    (dict(rewards=[1, 2, 3], group_size=2), "divide"),
    (dict(rewards=[1, 2], group_size=2, scale_rewards="std"), "scale_rewards"),
])
def test_group_advantages_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)


# --- per-token loss -----------------------------------------------------------------------------

def test_per_token_loss_on_policy_is_minus_advantage_with_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss = per_token_loss(logp, None, adv)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    loss.sum().backward()
    # ratio = exp(logp - stopgrad(logp)) = 1, d ratio / d logp = 1: the REINFORCE gradient -A
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))


def test_per_token_loss_clips_asymmetrically():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    adv = torch.tensor([1.0])
    # A > 0: gain capped at ratio 1 + eps_high; A < 0 caps the other side
    loss = per_token_loss(logp, old, adv, epsilon_low=0.2, epsilon_high=0.28)
    torch.testing.assert_close(loss, -torch.tensor([[1.28, 0.5, 1.28, 0.5]]))
    loss_neg = per_token_loss(logp, old, -adv, epsilon_low=0.2, epsilon_high=0.28)
    torch.testing.assert_close(loss_neg, torch.tensor([[1.5, 0.8, 1.5, 0.8]]))


def test_per_token_loss_k3_kl():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    d = -0.5
    loss = per_token_loss(logp, None, torch.tensor([0.0]), ref_logp=ref, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor([[0.1 * (math.exp(d) - d - 1)]]))
    with pytest.raises(ValueError, match="ref_logp"):
        per_token_loss(logp, None, torch.tensor([0.0]), beta=0.1)


# --- aggregation --------------------------------------------------------------------------------

def _example():
    per_token = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 5.0, 0.0, 0.0]])  # NaN is padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    return per_token, mask


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),
    ("bnpo", 15 / 5),
    ("dapo", 15 / 5),
    ("dr_grpo", 15 / (2 * 3)),  # max_completion_length defaults to the longest sequence
])
def test_aggregate_loss_types(loss_type, expected):
    per_token, mask = _example()
    assert aggregate_loss(per_token, mask, loss_type).item() == pytest.approx(expected)


def test_dr_grpo_uses_given_max_completion_length():
    per_token, mask = _example()
    assert aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=10).item() == pytest.approx(15 / 20)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_micro_batches_with_step_totals_sum_to_the_whole(loss_type):
    per_token, mask = _example()
    whole = aggregate_loss(per_token, mask, loss_type)
    totals = dict(num_seqs=2, num_tokens=5, max_completion_length=3)
    parts = sum(aggregate_loss(per_token[i:i + 1], mask[i:i + 1], loss_type, **totals) for i in range(2))
    assert parts.item() == pytest.approx(whole.item())


def test_token_weights_reject_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        loss_token_weights(torch.ones(1, 1), "sum")


# --- chunked logprobs ---------------------------------------------------------------------------

def test_chunked_logprobs_equal_full_logits_values_and_grads():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)

    chunked = token_logprobs(hidden, weight, targets, chunk_tokens=8)
    (g_chunked,) = torch.autograd.grad((chunked * upstream).sum(), hidden)
    naive = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    (g_naive,) = torch.autograd.grad((naive * upstream).sum(), hidden)

    torch.testing.assert_close(chunked.double(), naive, rtol=1e-6, atol=1e-6)  # fp32 output
    torch.testing.assert_close(g_chunked, g_naive, rtol=1e-6, atol=1e-6)


def test_chunked_logprobs_refuse_trainable_output_embedding():
    with pytest.raises(ValueError, match="freeze"):
        token_logprobs(torch.randn(2, 4), torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1]))
