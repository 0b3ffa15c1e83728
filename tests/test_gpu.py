"""The precision modes on a CUDA GPU: what they compute in, and that they train. Skipped without one."""

import pytest
import torch

from halfprec.train import run

from helpers import DTYPES, compose_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16", "fp16_pure", "bf16_pure"])
def test_precision_mode_on_cuda(precision, tmp_path):
    cfg = compose_cfg(f"precision={precision}", "trainer.device=cuda", "trainer.max_steps=200", "trainer.log_every=50")
    summary = run(cfg, tmp_path)
    assert (summary["precision/compute_dtype"], summary["precision/param_dtype"]) == DTYPES[precision]
    assert summary["val/acc"] > 0.9
    assert summary["scaler/skipped_steps"] <= 2


def test_tf32_flag_is_set_only_for_tf32(tmp_path):
    run(compose_cfg("precision=tf32", "trainer.device=cuda", "trainer.max_steps=2"), tmp_path / "a")
    assert torch.backends.cuda.matmul.allow_tf32
    run(compose_cfg("precision=fp32", "trainer.device=cuda", "trainer.max_steps=2"), tmp_path / "b")
    assert not torch.backends.cuda.matmul.allow_tf32
