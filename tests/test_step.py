"""The optimizer-step contract (docs/design.md) on the real components."""

import copy
from dataclasses import replace

import pytest
import torch

from helpers import batch, build_from, flat_params, step


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulation_equals_big_batch(optim):
    """fp32: accum=4 with micro-batch b leaves the same parameters as one batch of 4b."""
    b, k, steps = 8, 4, 5
    common = [f"optim={optim}", "model.hidden=[32,32]", "optim.weight_decay=0.01", "sched=constant"]
    big, _ = build_from(*common, "accum=1", f"data.batch_size={k * b}")
    small, _ = build_from(*common, f"accum={k}", f"data.batch_size={b}")
    torch.testing.assert_close(flat_params(big.model), flat_params(small.model), rtol=0, atol=0)
    for s in range(steps):
        x, y = batch(k * b, seed=s)
        step(big, [(x, y)])
        step(small, [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(k)])
    moved = (flat_params(big.model) - flat_params(build_from(*common)[0].model)).abs().max()
    assert moved > 1e-3  # the comparison below is not between two untrained models
    torch.testing.assert_close(flat_params(small.model), flat_params(big.model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("compute_norm", [True, False], ids=["norm", "fused-check"])
def test_injected_inf_skips_exactly_that_step(compute_norm):
    """An inf in one micro-batch: no parameter, optimizer-state or LR change; scale backed off.
    Both skip checks: the norm's (logged steps) and the fused one (the other steps)."""
    c, _ = build_from("precision=fp16", "accum=3", "data.batch_size=8", "model.hidden=[16]", "sched=cosine")
    for s in range(2):
        x, y = batch(24, seed=s)
        assert not step(c, [(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]) for i in range(3)]).skipped
    params = flat_params(c.model)
    opt_state = copy.deepcopy(c.stepper.optimizer.state_dict())
    sched_state = copy.deepcopy(c.stepper.scheduler.state_dict())
    lr = c.stepper.optimizer.param_groups[0]["lr"]
    scale = c.stepper.scaler.scale

    x, y = batch(24, seed=7)
    bad = x[16:].clone()
    bad[0, 0, 0, 0] = float("inf")
    result = step(c, [(x[:8], y[:8]), (x[8:16], y[8:16]), (bad, y[16:])], compute_norm=compute_norm)

    assert result.skipped
    assert torch.equal(flat_params(c.model), params)
    after = c.stepper.optimizer.state_dict()
    for key, buf in opt_state["state"].items():
        for name, value in buf.items():
            assert torch.equal(after["state"][key][name], value), name
    assert c.stepper.scheduler.state_dict() == sched_state
    assert c.stepper.optimizer.param_groups[0]["lr"] == lr
    assert c.stepper.scaler.scale == scale * 0.5
    assert c.stepper.scaler.skipped_steps == 1 and c.stepper.scaler.backoffs == 1
    # the next clean window steps again
    x, y = batch(24, seed=8)
    assert not step(c, [(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]) for i in range(3)]).skipped
    assert not torch.equal(flat_params(c.model), params)


def _grads_after_one_window(*overrides):
    c, _ = build_from("model.hidden=[32]", "optim.lr=0.0", "sched=constant", *overrides)
    x, y = batch(64, seed=3)
    result = step(c, [(x, y)])
    return c, result


def test_static_scaling_unscales_to_the_fp32_gradients():
    """Gradients seen by the optimizer equal the unscaled fp32 ones: the scale is divided out."""
    # fp32 math with a static scale: any difference from the unscaled run is the scaler's doing
    ref, ref_out = _grads_after_one_window("scaler=none")
    scaled, out = _grads_after_one_window("scaler=static", "scaler.scale=1024")
    assert scaled.stepper.scaler.scale == 1024
    for p, q in zip(ref.stepper.params.params, scaled.stepper.params.params):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.grad_norm, ref_out.grad_norm, rtol=1e-6, atol=0)


def test_fp16_unscaled_gradients_do_not_depend_on_the_scale():
    """fp16 autocast: power-of-two scales are exact, so unscaled grads at 128 and 2^16 agree bitwise
    (no underflow, no overflow) and stay close to fp32 (up to fp16 rounding of the forward)."""
    ref, _ = _grads_after_one_window("scaler=none")
    low, _ = _grads_after_one_window("precision=fp16", "scaler=static", "scaler.scale=128")
    high, _ = _grads_after_one_window("precision=fp16", "scaler=static", "scaler.scale=65536")
    for p, q in zip(low.stepper.params.params, high.stepper.params.params):
        assert q.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    g32 = torch.cat([p.grad.flatten() for p in ref.stepper.params.params])
    g16 = torch.cat([p.grad.flatten() for p in low.stepper.params.params])
    # a few ReLUs flip sign under fp16 rounding of the forward, hence not 1e-3
    assert ((g16 - g32).norm() / g32.norm()) < 0.1


def test_clipping_acts_on_unscaled_gradients():
    """With a large static scale the clipped update equals the fp32 clipped update."""
    common = ["model.hidden=[32]", "sched=constant", "optim.momentum=0.0"]
    ref, _ = build_from(*common, "scaler=none")
    scaled, _ = build_from(*common, "scaler=static", "scaler.scale=4096")
    x, y = batch(64, seed=5)
    r1 = step(ref, [(x, y)], clip=0.05)
    r2 = step(scaled, [(x, y)], clip=0.05)
    assert r1.grad_norm > 0.05  # clipping really happened
    torch.testing.assert_close(r2.grad_norm, r1.grad_norm, rtol=1e-6, atol=0)  # the pre-clip, unscaled norm
    clipped = torch.nn.utils.get_total_norm([p.grad for p in scaled.stepper.params.params])
    torch.testing.assert_close(clipped, torch.tensor(0.05), rtol=1e-5, atol=0)
    torch.testing.assert_close(flat_params(scaled.model), flat_params(ref.model), rtol=0, atol=1e-7)


def test_grad_norm_is_unscaled_for_dynamic_fp16():
    ref, r = _grads_after_one_window("scaler=none")
    fp16, f = _grads_after_one_window("precision=fp16")
    assert fp16.stepper.scaler.scale == 65536
    torch.testing.assert_close(f.grad_norm, r.grad_norm, rtol=1e-2, atol=0)


def test_loss_weight_with_inverse_lr_leaves_fp32_sgd_unchanged():
    """The loss_scaling experiment's simulated small gradients: loss * 2^-18 and lr * 2^18 is the
    same fp32 SGD run (powers of two: exact scaling), while fp16 without a scale loses them."""
    x, y = batch(64)
    plain, _ = build_from("optim.lr=0.1")
    weighted, _ = build_from(f"optim.lr={0.1 * 2**18}")
    for _ in range(3):
        step(plain, [(x, y)])
        r = replace(weighted.stepper, loss_weight=2**-18).step([(x, y)])
    torch.testing.assert_close(flat_params(weighted.model), flat_params(plain.model), rtol=1e-5, atol=1e-6)
    assert r.grad_norm < 1e-4  # the norm of the weighted gradients, which is what underflows in fp16


def test_steps_without_the_norm_do_the_same_math():
    """compute_norm=False (the steps the loop does not log) changes nothing but the missing norm;
    clipping computes it anyway."""
    common = ["precision=fp16", "model.hidden=[32]", "optim=adamw", "sched=cosine"]
    with_norm, _ = build_from(*common)
    without, _ = build_from(*common)
    for s in range(4):
        micro = [batch(16, seed=s)]
        a, b = step(with_norm, micro), step(without, micro, compute_norm=False)
        assert a.grad_norm is not None and b.grad_norm is None and not a.skipped and not b.skipped
    torch.testing.assert_close(flat_params(without.model), flat_params(with_norm.model), rtol=0, atol=0)
    assert without.stepper.scaler.state_dict() == with_norm.stepper.scaler.state_dict()
    clipped = step(without, [batch(16, seed=9)], clip=0.1, compute_norm=False)
    assert clipped.grad_norm is not None and clipped.grad_norm > 0


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_fused_nonfinite_check(bad):
    """One device and dtype: torch's fused check; mixed dtypes: the norm. Both find any inf/NaN."""
    from halfprec.numerics.grads import any_nonfinite

    uniform = [torch.randn(5, 3), torch.randn(7)]
    mixed = [torch.randn(5, 3), torch.randn(7, dtype=torch.bfloat16)]
    for grads in (uniform, mixed):
        before = [g.clone() for g in grads]
        if bad is not None:
            grads[1][3] = bad
        assert bool(any_nonfinite(grads)) == (bad is not None)
        if bad is None:  # nothing rescaled: the check multiplies by exactly 1
            assert all(torch.equal(g, b) for g, b in zip(grads, before))


@pytest.mark.parametrize("compute_norm", [True, False], ids=["norm", "fused-check"])
def test_skip_rule_does_not_depend_on_logging(compute_norm):
    """Skip iff a gradient holds inf/NaN (GradScaler's rule), on logged steps and the others alike:
    finite gradients whose sum of squares overflows fp32 step, and their logged norm is inf. With
    clipping, which needs a finite norm, that step is skipped on every step."""
    common = ["precision=fp32", "model.hidden=[32]", "sched=constant"]
    c, _ = build_from(*common)
    before = flat_params(c.model)
    huge = 1e30  # gradients of ~1e29: finite in fp32, their squares are not
    micro = [batch(16, seed=0)]
    result = replace(c.stepper, loss_weight=huge).step(micro, compute_norm=compute_norm)
    assert not result.skipped and torch.isfinite(flat_params(c.model)).all()
    assert not torch.equal(flat_params(c.model), before)
    if compute_norm:
        assert result.grad_norm.isinf()
    clipped, _ = build_from(*common)
    result = replace(clipped.stepper, clip_grad_norm=1.0, loss_weight=huge).step(micro, compute_norm=compute_norm)
    assert result.skipped and clipped.stepper.scaler.skipped_steps == 1
