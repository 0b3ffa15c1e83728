"""Loss-scaler state machines: torch parity, hysteresis, the floor and the skip-storm stop; the
scaler group's keys as its class's arguments, checked and handed over as they are."""

import random
import subprocess
import sys

import pytest
import torch
from conftest import CONF

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics.scaling import (
    SCALERS,
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    TrainingAborted,
    build_scaler,
)

from helpers import compose_cfg, typed_cfg


def overflow_pattern(n: int, seed: int = 0, p: float = 0.2) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def torch_trajectory(pattern, init_scale, growth_interval):
    """Scales torch.amp.GradScaler reports after each step on gradients that overflow as given."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for overflow in pattern:
        ref.scale(torch.ones(())).requires_grad_()  # initialises the scale tensor lazily
        w.grad = torch.full((1,), float("inf") if overflow else ref.get_scale())
        ref.step(opt)
        ref.update()
        scales.append(ref.get_scale())
    return scales


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_trajectory_equals_torch_gradscaler(seed):
    pattern = overflow_pattern(200, seed) + [False] * 20  # a clean tail exercises growth
    expected = torch_trajectory(pattern, init_scale=2.0**10, growth_interval=3)
    ours = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    got = []
    for overflow in pattern:
        ours.update(overflow)
        got.append(ours.scale)
    assert got == expected
    assert ours.growths > 0 and ours.backoffs > 0
    assert ours.skipped_steps == sum(pattern)


def test_defaults_match_torch():
    ours, ref = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert ours.scale == ref.get_scale() == 2.0**16
    assert ours.growth_factor == ref.get_growth_factor()
    assert ours.backoff_factor == ref.get_backoff_factor()
    assert ours.growth_interval == ref.get_growth_interval()


def test_hysteresis_tolerates_overflows_before_backing_off():
    s = DynamicLossScaler(init_scale=1024, growth_interval=100, hysteresis=3)
    s.update(True)
    s.update(True)
    assert s.scale == 1024 and s.skipped_steps == 2 and s.backoffs == 0  # skipped, not backed off
    s.update(True)
    assert s.scale == 512 and s.backoffs == 1  # the third overflow backs off
    s.update(False)
    s.update(True)
    assert s.scale == 256  # allowance used up: until the scale grows, every overflow backs off
    s.update(True)
    assert s.scale == 128


def test_hysteresis_matches_megatron_and_deepspeed_under_sustained_overflow():
    s = DynamicLossScaler(init_scale=1024, growth_interval=100, hysteresis=2)
    scales = []
    for _ in range(6):
        s.update(True)
        scales.append(s.scale)
    assert scales == [1024, 512, 256, 128, 64, 32]


def test_hysteresis_allowance_refills_when_the_scale_grows():
    s = DynamicLossScaler(init_scale=8, growth_interval=2, hysteresis=2)
    s.update(True)  # one overflow used up
    assert s.hysteresis_left == 1
    s.update(False)
    s.update(False)  # grows
    assert s.scale == 16 and s.hysteresis_left == 2
    s.update(True)
    assert s.scale == 16


def test_scale_underflow_to_zero_stops_the_run():
    s = DynamicLossScaler(init_scale=1.0, backoff_factor=1e-200)
    s.update(True)
    with pytest.raises(TrainingAborted, match="underflowed to 0"):
        s.update(True)


def test_state_dict_holds_state_not_settings():
    a = DynamicLossScaler(init_scale=256, growth_interval=3)
    a.update(True)
    b = DynamicLossScaler(init_scale=256, growth_interval=5, max_consecutive_skips=7)
    b.load_state_dict(a.state_dict())
    assert b.scale == 128 and b.skipped_steps == 1
    assert b.growth_interval == 5 and b.max_consecutive_skips == 7  # from b's own config


def test_min_scale_is_a_floor_and_an_overflow_at_the_floor_stops():
    s = DynamicLossScaler(init_scale=4, growth_interval=100, min_scale=1.5)
    s.update(True)
    assert s.scale == 2
    s.update(True)
    assert s.scale == 1.5  # clamped, not 1
    with pytest.raises(TrainingAborted, match=r"scaler.min_scale=1.5"):
        s.update(True)


def test_max_consecutive_skips_stops_a_skip_storm_but_not_scattered_skips():
    s = DynamicLossScaler(init_scale=2.0**16, max_consecutive_skips=3)
    for _ in range(10):
        s.update(True)
        s.update(True)
        s.update(False)  # a clean step resets the run of skips
    with pytest.raises(TrainingAborted, match=r"3 optimizer steps in a row.*max_consecutive_skips=3"):
        for _ in range(3):
            s.update(True)


def test_max_overflow_rate_stops_scattered_skips_once_more_than_that_share_of_100_steps_skip():
    """Two skips in every three steps never make a storm of 3 in a row, yet the run is diverging."""
    s = LossScaler(max_consecutive_skips=3, max_overflow_rate=0.5)
    with pytest.raises(TrainingAborted, match=r"51 of the last 100 optimizer steps.*max_overflow_rate=0\.5"):
        while True:
            s.update(True)
            s.update(True)
            s.update(False)
    assert s.steps == 76 and s.skipped_steps == 51  # stopped at the 51st skip, before the window filled


def test_max_overflow_rate_lets_half_the_steps_skip_and_a_fresh_scale_back_off():
    s = DynamicLossScaler(init_scale=2.0**24, max_overflow_rate=0.5)
    for step in range(100):  # a too-high initial scale backs off for a few steps: no divergence
        s.update(step < 8)
    for _ in range(300):  # at most half of any 100 steps skipped: training goes on
        s.update(False)
        s.update(True)
    assert s.skipped_steps == 308


@pytest.mark.parametrize("scaler", [LossScaler(max_consecutive_skips=2), StaticLossScaler(128, 2)])
def test_skip_storm_applies_without_dynamic_scaling(scaler):
    scaler.update(True)
    with pytest.raises(TrainingAborted):
        scaler.update(True)


def test_static_scale_never_moves_but_counts_skips():
    s = StaticLossScaler(128)
    for overflow in [True, False, True, True, False]:
        s.update(overflow)
    assert s.scale == 128 and s.skipped_steps == 3 and s.growths == s.backoffs == 0
    assert s.overflow_rate == pytest.approx(3 / 5)


def test_state_dict_round_trip_continues_identically():
    pattern = overflow_pattern(60, seed=4, p=0.3)
    a = DynamicLossScaler(init_scale=256, growth_interval=2, hysteresis=2, min_scale=1e-3)
    for overflow in pattern[:30]:
        a.update(overflow)
    b = DynamicLossScaler(init_scale=256, growth_interval=2, hysteresis=2, min_scale=1e-3)  # same config
    b.load_state_dict(a.state_dict())
    for overflow in pattern[30:]:
        a.update(overflow)
        b.update(overflow)
        assert b.scale == a.scale
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "scaler").glob("*.yaml")))
def test_each_option_is_its_class_made_with_its_keys(option):
    """The typed config holds scaler.kind and the other keys, which build_scaler hands over as they are."""
    config = typed_cfg(f"scaler={option}", "precision=fp16")
    scaler = build_scaler(config.scaler, uses_fp16=True)
    assert type(scaler) is SCALERS[config.scaler.name]
    for key, value in config.scaler.args.items():
        assert (scaler.scale if key in ("scale", "init_scale") else getattr(scaler, key)) == value, key


def test_auto_is_dynamic_for_fp16_and_otherwise_none_with_only_the_stops():
    config = typed_cfg("scaler=auto", "scaler.init_scale=1024", "scaler.max_consecutive_skips=7")
    fp16 = build_scaler(config.scaler, uses_fp16=True)
    assert type(fp16) is DynamicLossScaler and fp16.scale == 1024 and fp16.max_consecutive_skips == 7
    other = build_scaler(config.scaler, uses_fp16=False)
    assert type(other) is LossScaler and other.scale == 1.0 and other.max_consecutive_skips == 7
    assert other.max_overflow_rate == config.scaler.args["max_overflow_rate"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["scaler.kind=fixed"], "scaler.kind=fixed: must be one of none, static, dynamic, auto"),
        (["scaler=static", "+scaler.init_scale=1024"], "scaler.init_scale=1024: unknown key for scaler.kind=static"),
        (["scaler.hysteresis=0"], "scaler.hysteresis=0: must be an integer >= 1 (overflows tolerated before"),
        (["scaler=none", "scaler.max_overflow_rate=2"], "scaler.max_overflow_rate=2: must be a number > 0 and <= 1"),
    ],
)
def test_a_bad_scaler_key_is_one_line_from_its_class_annotations(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


CHECK_WITHOUT_TORCH = """
import sys
from hydra import compose, initialize_config_dir
from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.config.resolvers import register_resolvers

register_resolvers()
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    cfg = compose("train", overrides=["scaler=static", "scaler.scale=0"])
try:
    validate(cfg)
except ConfigError as err:
    print(err, "torch" in sys.modules)
"""


def test_a_bad_scaler_key_answers_without_importing_torch():
    out = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_TORCH, str(CONF)], capture_output=True, text=True)
    assert out.stdout.strip() == "scaler.scale=0: must be a number > 0 (the fixed loss scale, e.g. 128) False", out
