"""Precision modes: dtypes really used, master weights, and low-precision update rounding."""

import copy

import pytest
import torch
from torch import nn

from halfprec.components.tasks import Task
from halfprec.components.tasks.classification import Classification
from halfprec.numerics.params import build_params
from halfprec.numerics.policy import PrecisionMismatch, PrecisionPolicy, observe_compute_dtypes
from halfprec.numerics.rounding import stochastic_round_to_bf16
from halfprec.numerics.scaling import DynamicLossScaler, LossScaler
from halfprec.training.step import Stepper

from helpers import batch, typed_cfg

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def policy(name: str, **overrides) -> PrecisionPolicy:
    cfg = typed_cfg(f"precision={name}", *(f"precision.{k}={v}" for k, v in overrides.items()))
    return PrecisionPolicy.from_config(cfg.precision, "cpu")


def normed_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 16),
        nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10),
    )  # fmt: skip


def test_fp16_pure_stores_fp16_weights_fp32_norms_and_fp32_master_weights():
    model, p = normed_net(), policy("fp16_pure")
    kept = p.prepare_model(model)
    params = build_params(model, p)
    assert {type(m) for m in kept} == {nn.LayerNorm, nn.BatchNorm1d}
    assert all(m.weight.dtype == F16 for m in model if isinstance(m, nn.Linear))
    assert all(m.weight.dtype == F32 for m in kept)
    assert all(m.dtype == F32 for m in params.master) and len(params.master) == len(list(model.parameters()))
    x, y = batch(32)
    with observe_compute_dtypes(model) as seen:
        out = model(p.cast_input(x))
    assert out.dtype == F16 and seen == {F16}
    info = p.check(model, seen, params.master)
    assert info["precision/param_dtype"] == "float16" and info["precision/master_dtype"] == "float32"


def test_fp16_pure_trains_through_the_step_and_keeps_dtypes():
    model, p = normed_net(), policy("fp16_pure")
    p.prepare_model(model)
    params = build_params(model, p)
    opt = torch.optim.SGD(params.params, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = DynamicLossScaler()
    x, y = batch(64)
    losses = [
        Stepper(model, Classification(), p, params, opt, sched, scaler).step([(x, y)]).loss.item() for _ in range(20)
    ]
    assert losses[-1] < 0.5 * losses[0]
    assert all(m.weight.dtype == F16 for m in model if isinstance(m, nn.Linear))
    assert all(m.dtype == F32 for m in params.master)
    # the model is the rounded master: what the optimizer learned reached the forward
    for w, m in zip(model.parameters(), params.master):
        assert torch.equal(w, m.to(w.dtype))


def test_o3_casts_norms_too():
    model, p = normed_net(), policy("O3")
    assert p.prepare_model(model) == []
    assert all(prm.dtype == F16 for prm in model.parameters())


def test_precision_mismatch_is_caught():
    class Fp32Island(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return self.lin(x.flatten(1).float())

    model, p = Fp32Island(), policy("fp16")
    with observe_compute_dtypes(model) as seen:
        with p.autocast():
            model(batch(4)[0])
    with pytest.raises(PrecisionMismatch, match="computed in float32, expected float16"):
        p.check(model, seen, [])


class Linear(Task):
    """loss = grad * sum(output): every output gets the gradient `grad`, whatever the targets."""

    def __init__(self, grad: float):
        self.grad = grad

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.grad * output.sum()


def one_weight_updates(p: PrecisionPolicy, grad: float, lr: float, steps: int) -> float:
    """A single weight (1.0 in the policy's storage dtype) under `steps` SGD updates of -lr*grad."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.ones_(model.weight)
    p.prepare_model(model)
    params = build_params(model, p)
    opt = torch.optim.SGD(params.params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = LossScaler()
    x, y = torch.ones(1, 1), torch.zeros(1, dtype=torch.long)
    for _ in range(steps):
        Stepper(model, Linear(grad), p, params, opt, sched, scaler).step([(x, y)])
    assert model.weight.dtype == p.param_dtype
    return model.weight.item()


def test_naive_fp16_loses_small_updates_that_master_weights_keep():
    # 1e-4 is below half an fp16 ulp at 1.0 (2^-11): rounding to nearest drops every update
    naive = one_weight_updates(policy("fp16_pure", master_weights="false"), grad=1.0, lr=1e-4, steps=500)
    master = one_weight_updates(policy("fp16_pure"), grad=1.0, lr=1e-4, steps=500)
    assert naive == 1.0
    assert master == pytest.approx(0.95, abs=1e-3)


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_bf16_kahan_and_stochastic_move_a_weight_that_nearest_leaves_stuck(update):
    torch.manual_seed(0)
    # 1,000 additions of 1e-3 to a bf16 1.0: each is below half a bf16 ulp (2^-8)
    nearest = one_weight_updates(policy("bf16_pure"), grad=-1.0, lr=1e-3, steps=1000)
    moved = one_weight_updates(policy("bf16_pure", update=update), grad=-1.0, lr=1e-3, steps=1000)
    master = one_weight_updates(policy("bf16_pure", master_weights="true"), grad=-1.0, lr=1e-3, steps=1000)
    assert nearest == 1.0
    # Kahan lands on 2.0; stochastic rounding is unbiased with std ~0.08 here (1,000 coin flips
    # of probability 0.128 between neighbours 2^-7 apart)
    assert moved == pytest.approx(2.0, abs=0.01 if update == "kahan" else 0.3)
    assert master == pytest.approx(2.0, abs=0.01)


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    torch.manual_seed(0)
    x = torch.full((100_000,), 1.0 + 2**-9)  # a quarter of the way from 1.0 to the next bf16 (1 + 2^-7)
    r = stochastic_round_to_bf16(x).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert r.mean().item() == pytest.approx(1.0 + 2**-9, abs=6e-5)  # 5 sigma for 100k samples
    exact = torch.tensor([1.0, -2.5, 0.0])
    assert torch.equal(stochastic_round_to_bf16(exact).float(), exact)  # representable values stay


def test_skipped_step_leaves_low_precision_weights_untouched():
    model, p = normed_net(), policy("bf16_pure", update="kahan")
    p.prepare_model(model)
    params = build_params(model, p)
    opt = torch.optim.SGD(params.params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = [w.clone() for w in model.parameters()]
    x, y = batch(8)
    x[0, 0, 0, 0] = float("nan")
    assert Stepper(model, Classification(), p, params, opt, sched, LossScaler()).step([(x, y)]).skipped
    for w, b in zip(model.parameters(), before):
        assert w.dtype == b.dtype and torch.equal(w, b)


def test_stochastic_rounding_leaves_fp32_norms_fp32():
    model, p = normed_net(), policy("bf16_pure", update="stochastic")
    kept = p.prepare_model(model)
    params = build_params(model, p)
    opt = torch.optim.SGD(params.params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x, y = batch(16)
    for _ in range(3):
        assert not Stepper(model, Classification(), p, params, opt, sched, LossScaler()).step([(x, y)]).skipped
    assert all(w.dtype == F32 for m in kept for w in m.parameters())
    assert all(m.weight.dtype == BF16 for m in model if isinstance(m, nn.Linear))


def test_optimizer_state_stays_fp32_across_a_reload_in_pure_bf16():
    model, p = normed_net(), policy("bf16_pure", update="kahan")
    p.prepare_model(model)
    params = build_params(model, p)
    opt = torch.optim.AdamW(params.params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x, y = batch(16)
    Stepper(model, Classification(), p, params, opt, sched, LossScaler()).step([(x, y)])
    saved = copy.deepcopy(opt.state_dict())
    fresh = torch.optim.AdamW(params.params, lr=1e-3)
    params.load_optimizer_state(fresh, saved)
    states = [s for s in fresh.state.values()]
    assert states and all(s["exp_avg"].dtype == F32 and s["exp_avg_sq"].dtype == F32 for s in states)
    assert Stepper(model, Classification(), p, params, fresh, sched, LossScaler()).step([(x, y)]).loss.isfinite()


def test_injected_nonfinite_gradient_skips_without_touching_batchnorm_stats():
    from halfprec.training.probes import inject_nonfinite_grad

    model, p = normed_net(), policy("fp32")
    params = build_params(model, p)
    opt = torch.optim.SGD(params.params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x, y = batch(32)
    handle = inject_nonfinite_grad(model, accum=2)
    result = Stepper(model, Classification(), p, params, opt, sched, LossScaler()).step(
        [(x[:16], y[:16]), (x[16:], y[16:])]
    )
    handle.remove()
    assert result.skipped
    bn = model[5]
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
