"""precision.master=remainder: exact fp32 master weights kept as bf16 weights and int16 remainders
(numerics/rounding.py, RemainderRounding), against fp32 master weights kept beside the weights."""

from __future__ import annotations

import pytest
import torch
from conftest import read_jsonl

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics import params as params_module
from halfprec.numerics.rounding import split_bf16
from halfprec.training.run import run

from helpers import compose_cfg


def test_an_fp32_value_is_its_bf16_and_remainder_exactly_and_ties_go_away_from_zero():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.exp2(torch.randint(-100, 100, (200_000,), generator=gen).float())
    ties = torch.tensor([1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 2**-130 + 2**-140])  # halfway between two bf16s
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0])])
    high, remainder = split_bf16(x)
    rebuilt = (high.view(torch.int16).int() << 16) + remainder.int()
    assert torch.equal(rebuilt, x.view(torch.int32))
    assert remainder.dtype == torch.int16
    differs = high != x.bfloat16()  # round to nearest, ties to even
    low_bits = x.view(torch.int32) & 0xFFFF
    assert bool((low_bits[differs] == 0x8000).all())  # only at exact ties (and not at those RNE rounds up)
    assert differs[-7:-5].all() and not differs[-5]  # 1 + 3 * 2^-8: the even neighbour is the upper one
    assert high[-7].item() == 1 + 2**-7 and high[-6].item() == -(1 + 2**-7)  # away from zero, not to even


def master_copy_ties_away(monkeypatch):
    """MasterWeights copying its fp32 masters into the bf16 weights with ties away from zero, as
    the remainder scheme must (it rounds to nearest otherwise, as torch's copy does)."""

    def finish_(self, stepped: bool) -> None:
        with torch.no_grad():
            if stepped:
                for m, p in zip(self.params, self.model_params):
                    p.copy_(split_bf16(m)[0] if p.dtype == torch.bfloat16 else m)
            for m in self.params:
                m.grad = None

    monkeypatch.setattr(params_module.MasterWeights, "finish_", finish_)


COMMON = ["accum=2", "trainer.inject_nonfinite_at=[7,150]", "trainer.log_every=1", "trainer.val_every=0",
          "sched.total_steps=240", "optim.lr=0.05", "trainer.ckpt_every=120"]  # fmt: skip


def test_remainders_rebuild_the_fp32_masters_bit_for_bit_through_skips_accumulation_and_resume(tmp_path, monkeypatch):
    """240 steps (two skipped, two micro-batches each) of the digits MLP in pure bf16: with the
    same rounding of the bf16 copy, every loss, every weight and every rebuilt master equal those
    of fp32 master weights; the remainder run stops at step 120 and resumes."""
    master_copy_ties_away(monkeypatch)
    run(compose_cfg("precision=bf16_pure_master", *COMMON, "trainer.max_steps=240"), tmp_path / "fp32")
    remainder = ["precision=bf16_pure", "precision.master=remainder", *COMMON]
    run(compose_cfg(*remainder, "trainer.max_steps=120"), tmp_path / "rem")
    run(compose_cfg(*remainder, "trainer.max_steps=240", "resume=auto"), tmp_path / "rem")
    rows = [read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("fp32", "rem")]
    assert [r.get("train/loss") for r in rows[0]] == [r.get("train/loss") for r in rows[1]]
    assert rows[1][0]["precision/master"] == "remainder" and rows[1][-1]["scaler/skipped_steps"] == 2
    a, b = (torch.load(tmp_path / d / "checkpoints" / "step-00000240.pt", weights_only=False) for d in ("fp32", "rem"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    bf16 = [w for w in b["model"].values() if w.dtype == torch.bfloat16]
    remainders = b["params"]["kahan"]
    assert len(bf16) == len(remainders) == len(a["params"]["master"])
    for weight, rem, master in zip(bf16, remainders, a["params"]["master"]):
        rebuilt = ((weight.view(torch.int16).int() << 16) + rem.int()).view(torch.float32)
        assert torch.equal(rebuilt, master)


def test_against_fp32_masters_rounded_to_nearest_even_the_difference_is_rounding_noise(tmp_path):
    run(compose_cfg("precision=bf16_pure_master", *COMMON, "trainer.max_steps=240"), tmp_path / "fp32")
    run(compose_cfg("precision=bf16_pure", "precision.master=remainder", *COMMON, "trainer.max_steps=240"),
        tmp_path / "rem")  # fmt: skip
    losses = [[r["train/loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "train/loss" in r]
              for d in ("fp32", "rem")]  # fmt: skip
    assert losses[0] != losses[1]  # ties do occur
    assert losses[1][-1] == pytest.approx(losses[0][-1], rel=0.05)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision=fp16_pure", "precision.master=remainder"], "precision.master=remainder: splits fp32 masters"),
        (["precision=bf16", "precision.master=remainder"], "precision.master=remainder: precision=bf16 keeps fp32"),
        (["precision=bf16_pure", "precision.master=remainder", "precision.update=kahan"], "precision.update=kahan"),
        (["precision=bf16_pure", "precision.master=float32"], "precision.master=float32: must be"),
    ],
)
def test_remainder_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*overrides))
