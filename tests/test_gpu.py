"""The precision modes on a CUDA GPU: what they compute in, and that they train. Skipped without one."""

import json
import warnings

import pytest
import torch

from halfprec.training.perf import peak_tflops
from halfprec.training.run import run

from helpers import DTYPES, batch, build_from, compose_cfg, same_bits, step, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16", "fp16_pure", "bf16_pure"])
def test_precision_mode_on_cuda(precision, tmp_path):
    cfg = compose_cfg(f"precision={precision}", "trainer.device=cuda", "trainer.max_steps=200", "trainer.log_every=50")
    summary = run(cfg, tmp_path)
    assert (summary["precision/compute_dtype"], summary["precision/param_dtype"]) == DTYPES[precision]
    assert summary["val/acc"] > 0.9
    assert summary["scaler/skipped_steps"] <= 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    perf = [r for r in rows if "perf/tflops" in r]
    assert perf and all(r["perf/tflops"] > 0 for r in perf)
    if peak_tflops(torch.device("cuda"), "half"):  # a chip in the table: MFU, a fraction of its peak
        assert all(0 < r["perf/mfu"] < 1 for r in perf), [r["perf/mfu"] for r in perf]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_pure_stochastic"])
def test_the_language_model_trains_on_cuda_and_logs_tokens_and_mfu(precision, tmp_path):
    cfg = compose_cfg("task=lm", f"precision={precision}", "trainer.device=cuda", "trainer.log_every=50")
    summary = run(cfg, tmp_path)
    assert summary["val/bpb"] < 3.6  # 400 steps: ~3.2 on a CPU in fp32; the untrained model is at 8
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    perf = [r for r in rows if "perf/tokens_per_s" in r and "perf/tflops" in r]
    assert perf and all(r["perf/tokens_per_s"] > 0 and r["perf/tflops"] > 0 for r in perf)
    if peak_tflops(torch.device("cuda"), "half"):
        assert all(0 < r["perf/mfu"] < 1 for r in perf), [r["perf/mfu"] for r in perf]


def test_tf32_flag_is_set_only_for_tf32(tmp_path):
    run(compose_cfg("precision=tf32", "trainer.device=cuda", "trainer.max_steps=2"), tmp_path / "a")
    assert torch.backends.cuda.matmul.allow_tf32
    run(compose_cfg("precision=fp32", "trainer.device=cuda", "trainer.max_steps=2"), tmp_path / "b")
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.distributed
@pytest.mark.parametrize(("trainer", "precision"), [("ddp", "fp16"), ("fsdp", "bf16"), ("fsdp", "fp16")])
def test_torchrun_on_cuda_with_nccl(trainer, precision, tmp_path):
    # one process per GPU (one is enough to exercise nccl, the device placement and FSDP's
    # MixedPrecisionPolicy on CUDA); both scale and skip machinery run under fp16
    nproc = min(torch.cuda.device_count(), 2)
    overrides = [f"trainer={trainer}", f"precision={precision}", "trainer.device=cuda", "logger=none"]
    overrides += ["trainer.max_steps=200", "trainer.log_every=50", "trainer.inject_nonfinite_at=[10]"]
    # a hang in nccl must not take the rest of gpu.sh's time for the GPU tests with it
    result = torchrun(tmp_path, *overrides, f"hydra.run.dir={tmp_path / 'run'}", nproc=nproc, tiny=False, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["precision/compute_dtype"], summary["precision/param_dtype"]) == (DTYPES[precision][0], "float32")
    assert summary["world_size"] == nproc and summary["scaler/skipped_steps"] >= 1
    assert summary["val/acc"] > 0.9


@pytest.mark.parametrize("compute_norm", [True, False], ids=["norm", "fused-check"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_pure_master"])
def test_the_step_syncs_the_host_once(precision, compute_norm):
    # the skip decision needs one device-to-host read per optimizer step; nothing else may wait on
    # the GPU, whether the step computes the grad norm (logged steps) or the fused check (the others)
    c, _ = build_from(f"precision={precision}", "trainer.device=cuda", "accum=2")
    micro = [tuple(t.cuda() for t in batch(64, seed=i)) for i in range(2)]
    for _ in range(3):  # warm-up: lazy inits (cuBLAS handles, optimizer state) may sync once
        step(c, micro)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(10):
                step(c, micro, compute_norm=compute_norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 10, [str(w.message)[:200] for w in syncs[:5]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_training_loop_adds_no_host_sync_between_logged_steps(precision, tmp_path):
    # the whole of train.py's loop (data, step, loss accumulation, schedule, bookkeeping), not the
    # step alone: two runs that differ by 10 steps that log nothing differ by exactly the 10 skip
    # decisions; build, the first step, the logged rows, the final validation and checkpoint are
    # the same in both
    def syncs(max_steps: int, name: str) -> int:
        overrides = [f"precision={precision}", "trainer.device=cuda", f"trainer.max_steps={max_steps}"]
        overrides += ["trainer.log_every=1000", "trainer.val_every=0", "trainer.ckpt_every=0"]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run(compose_cfg(*overrides), tmp_path / name)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    syncs(3, "warm-up")  # first uses (cuBLAS handles, allocator, both skip checks: step 2 logs nothing)
    short = syncs(3, "short")
    assert syncs(13, "long") - short == 10


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores"
)
@pytest.mark.parametrize("option, fmt", [("fp8", "fp8_e4m3"), ("fp8_row", "fp8_e4m3_row")])
def test_fp8_loss_curve_follows_bf16(option, fmt, tmp_path):
    # 300 steps of the digits MLP, widened so that fp8 does real work: the curves agree row by row
    common = ["trainer.device=cuda", "trainer.max_steps=300", "trainer.log_every=25", "model.hidden=[512,512]"]
    fp8 = run(compose_cfg(f"precision={option}", *common), tmp_path / "fp8")
    bf16 = run(compose_cfg("precision=bf16", *common), tmp_path / "bf16")
    assert fp8[f"precision/layers/{fmt}"] == 2
    curve = [json.loads(line)["train/loss"] for line in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["train/loss"] for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert len(curve) == len(ref) and all(abs(a - b) < 0.05 + 0.1 * b for a, b in zip(curve, ref)), (curve, ref)
    assert fp8["val/acc"] > 0.95 and abs(fp8["val/acc"] - bf16["val/acc"]) < 0.02


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "fp8_block", "mxint8"])
def test_the_compiled_quantizer_on_cuda_gives_the_eager_values_bit_for_bit(name):
    """Triton's kernels (precision.quantizer=auto on a GPU) against the eager ops on the same GPU,
    stochastic rounding from the same draws: divisions and roundings must be IEEE's there too
    (tests/triton_interpreter.py runs these kernels without a GPU, with numpy's IEEE arithmetic)."""
    from halfprec.numerics.formats import FORMATS, quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1030, 768, device="cuda", generator=g) * torch.logspace(-6, 6, 768, device="cuda")
    x[3, 5] = float("inf")
    for tile in [False, True] if FORMATS[name].tile else [False]:
        for axis in (-1, 0):
            for rounding in ("nearest", "stochastic"):
                eager, compiled = (
                    quantize(x, name, axis, rounding, torch.Generator(device="cuda").manual_seed(1), tile, compiled=c)[
                        0
                    ]
                    for c in (False, True)
                )
                assert same_bits(eager, compiled), (tile, axis, rounding)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "mxint8", "nvfp4", "fp8_e4m3_row"])
def test_a_layers_gemms_take_bf16_operands_and_give_the_fp32_products(name):
    """quantized.gemm on a GPU: bf16 operands (exact, the outer scales split off), fp32 output; the
    same products as fp32 operands, so only the order of the fp32 sums may differ."""
    from halfprec.numerics.formats import quantize
    from halfprec.numerics.quantized import Operand, gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (quantize(torch.randn(512, 1024, device="cuda", generator=g), name, split=True) for _ in range(2))
    assert torch.equal(a.values.bfloat16().float(), a.values)
    narrow, wide = (gemm(Operand(a.values, a.factor, x), Operand(b.values, b.factor, x).t()) for x in (True, False))
    assert narrow.dtype == torch.float32
    torch.testing.assert_close(narrow, wide, rtol=1e-5, atol=1e-4)  # the sums' order alone
