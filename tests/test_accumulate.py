"""numerics/accumulate.py bit for bit against MMA-Sim's instruction simulators (the `mmasim` package,
a test-only reference): random small matrices whose values span the elements' exponents, with
zeros and exact cancellations, for each preset's instruction and operand kind."""

import pytest
import torch

from halfprec.numerics import accumulate as acc

nv = pytest.importorskip("mmasim.nv_ptx")

M, K, N = 4, 256, 8
SEEDS = (0, 1, 2)
FP8 = {"e4m3": (torch.float8_e4m3fn, -6), "e5m2": (torch.float8_e5m2, -14)}
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])


def fp8(shape, element, g):
    """Every finite code of the element equally likely, a tenth of them zeros."""
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(FP8[element][0]).float()
    x[~x.isfinite() | (torch.rand(shape, generator=g) < 0.1)] = 0
    return x


def cancelling(a, b):
    """b's first column a's first row (a sum of squares: the largest products); a's second row and b's
    second column in pairs (x, x) and (y, -y): the sum cancels exactly to zero."""
    b[:, 0] = a[0]
    a[1, 1::2], b[1::2, 1] = a[1, ::2], -b[::2, 1]
    return a, b


def bf16(shape, g):
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.1] = 0
    return x.bfloat16().float()


def fp4(shape, g):
    signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return E2M1[torch.randint(0, 8, shape, generator=g)] * signs


PLAIN = [  # (simulator, instruction, element); the simulators loop over K a fused dot product at a time
    (lambda e: nv.WGMMA("Hopper", f"m64n8k32.f32.{e}.{e}"), acc.WGMMA_FP8, "e4m3"),
    (lambda e: nv.WGMMA("Hopper", f"m64n8k32.f32.{e}.{e}"), acc.WGMMA_FP8, "e5m2"),
    (lambda e: nv.MMA("Ada Lovelace", f"m16n8k32.f32.{e}.{e}.f32"), acc.MMA_FP8_SM89, "e4m3"),
    (lambda e: nv.TCGen05MMA("Blackwell", f"m64n8k32.kind::f8f6f4.f32.{e}.{e}"), acc.TCGEN05_F8F6F4, "e4m3"),
    (lambda e: nv.WGMMA("Hopper", "m64n8k16.f32.bf16.bf16"), acc.WGMMA_BF16, "bf16"),
    (lambda e: nv.MMA("Ampere", "m16n8k16.f32.bf16.bf16.f32"), acc.MMA_BF16_SM80, "bf16"),
    (lambda e: nv.TCGen05MMA("Blackwell", "m64n8k16.kind::f16.f32.bf16.bf16"), acc.TCGEN05_BF16, "bf16"),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("simulator", "ins", "element"), PLAIN, ids=[f"{p[1].name}-{p[2]}" for p in PLAIN])
def test_plain_instructions_equal_mmasim(simulator, ins, element, seed):
    g = torch.Generator().manual_seed(seed)
    if element == "bf16":
        a, b = cancelling(bf16((M, K), g), bf16((K, N), g))
        ta, tb, sub = a.bfloat16(), b.bfloat16(), -126
    else:
        a, b = cancelling(fp8((M, K), element, g), fp8((K, N), element, g))
        ta, tb, sub = a.to(FP8[element][0]), b.to(FP8[element][0]), FP8[element][1]
    expected = simulator(element).arithmetic_op(ta, tb, torch.zeros(M, N))
    assert torch.equal(acc.matmul(a, b, ins, (sub, sub)), expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_promotion_adds_partial_sums_in_fp32(seed):
    """hopper_promoted: every 128 of K the wgmma sum, from zero, added to an fp32 accumulator."""
    g = torch.Generator().manual_seed(seed)
    a, b = fp8((M, 512), "e4m3", g), fp8((512, N), "e4m3", g)
    sim = nv.WGMMA("Hopper", "m64n8k32.f32.e4m3.e4m3").arithmetic_op
    ta, tb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    expected = sum(sim(ta[:, i : i + 128], tb[i : i + 128], torch.zeros(M, N)) for i in range(0, 512, 128))
    preset = acc.PRESETS["hopper_promoted"]
    assert torch.equal(acc.matmul(a, b, preset.instructions["fp8"], (-6, -6), preset.promote), expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_mxf8f6f4_block_scaled_equals_mmasim(seed):
    """Blackwell's MXFP8: E8M0 scales per 32 of K, one per instruction (MMA-Sim takes one instruction
    at a time here)."""
    g = torch.Generator().manual_seed(seed)
    a, b = cancelling(fp8((M, K), "e4m3", g), fp8((K, N), "e4m3", g))
    sa = torch.exp2(torch.randint(-20, 20, (M, K // 32), generator=g).float())
    sb = torch.exp2(torch.randint(-20, 20, (K // 32, N), generator=g).float())
    sim = nv.TCGen05MMABlockScale("Blackwell", "m128n8k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0")
    expected = torch.zeros(M, N)
    e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    for i in range(K // 32):
        ks = slice(32 * i, 32 * i + 32)
        sa_i, sb_i = sa[:, i : i + 1].to(e8m0), sb[i : i + 1].to(e8m0)
        expected = sim.arithmetic_op(a[:, ks].to(e4m3), b[ks].to(e4m3), expected, sa_i, sb_i)
    got = acc.matmul(a, b, acc.TCGEN05_MXF8F6F4, (-6, -6), scales=(sa, sb), block=32)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("kind", "block", "scale"), [("mxf4nvf4", 16, "ue4m3"), ("mxf4", 32, "ue8m0")])
def test_fp4_block_scaled_equals_mmasim(kind, block, scale, seed):
    """NVFP4 (UE4M3 scales per 16, subnormal ones included) and MXFP4 (E8M0 per 32)."""
    g = torch.Generator().manual_seed(seed)
    a, b = cancelling(fp4((M, K), g), fp4((K, N), g))
    if scale == "ue4m3":
        sa, sb = fp8((M, K // block), "e4m3", g).abs(), fp8((K // block, N), "e4m3", g).abs()
        dtype, subnormal = torch.float8_e4m3fn, -6
    else:
        sa = torch.exp2(torch.randint(-20, 20, (M, K // block), generator=g).float())
        sb = torch.exp2(torch.randint(-20, 20, (K // block, N), generator=g).float())
        dtype, subnormal = torch.float8_e8m0fnu, -127
    sim = nv.TCGen05MMABlockScale("Blackwell", f"m128n8k64.kind::{kind}.block{block}.f32.e2m1.e2m1.{scale}")
    expected = sim.arithmetic_op(a.half(), b.half(), torch.zeros(M, N), sa.to(dtype), sb.to(dtype))
    got = acc.matmul(a, b, acc.TCGEN05_MXF4NVF4, (0, 0), scales=(sa, sb), block=block, scale_subnormal=subnormal)
    assert torch.equal(got, expected)


def test_ragged_k_pads_with_zeros():
    """K not a multiple of the instruction's: the tail padded with zeros, as a kernel pads its tile."""
    g = torch.Generator().manual_seed(3)
    a, b = fp8((M, 100), "e4m3", g), fp8((100, N), "e4m3", g)
    padded = acc.matmul(torch.nn.functional.pad(a, (0, 28)), torch.nn.functional.pad(b, (0, 0, 0, 28)), acc.WGMMA_FP8)
    assert torch.equal(acc.matmul(a, b, acc.WGMMA_FP8), padded)


# --- precision.accumulate: the quantized layers' GEMMs summed as a preset's GPU sums them

from halfprec.errors import ConfigError  # noqa: E402
from halfprec.numerics.quantized import Operand, QuantizedLinear, Recipe, gemm  # noqa: E402

GPT = ("task=lm", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
       "data.batch_size=2", "trainer.max_steps=2", "trainer.val_every=0", "precision.autocast=null",
       "precision.kernel=emulated")  # fmt: skip


def test_promotion_keeps_the_error_of_a_long_k_below_hoppers():
    """DeepSeek-V3's finding: FP8 wgmma sums lose accuracy as K grows; promoting every 128 restores it."""
    g = torch.Generator().manual_seed(0)
    a = fp8((4, 4096), "e4m3", g).abs()  # positive: a growing sum, whose small products lose their bits
    b = fp8((4096, 4), "e4m3", g).abs()
    exact = a.double() @ b.double()

    def error(name):
        got = gemm(Operand(a, None, True, element="e4m3"), Operand(b, None, True, element="e4m3"), acc.PRESETS[name])
        return ((got.double() - exact).norm() / exact.norm()).item()

    assert error("hopper_promoted") < error("hopper") / 10
    assert error("exact") < error("hopper_promoted")


def test_exact_is_todays_gemm():
    g = torch.Generator().manual_seed(1)
    a, b = Operand(fp8((8, 64), "e4m3", g), torch.tensor(0.5), True), Operand(fp8((64, 8), "e4m3", g), None, True)
    assert torch.equal(gemm(a, b, acc.PRESETS["exact"]), gemm(a, b))


def test_a_gemm_without_an_instruction_is_one_config_error_at_build():
    with pytest.raises(ConfigError, match=r"^precision.accumulate=hopper: .*no MMA instruction.* fp8, bf16"):
        QuantizedLinear(64, 64, False, "mxfp4", Recipe(), 0, accumulate="hopper")
    with pytest.raises(ConfigError, match=r"^precision.recipe.wgrad_accumulate=volta: an accumulation preset"):
        QuantizedLinear(64, 64, False, "fp8_e4m3", Recipe(wgrad_accumulate="volta"), 0)


def test_recipe_chooses_per_gemm():
    """TransformerEngine on Hopper: the forward's sums unpromoted, the backward's promoted."""
    recipe = Recipe(dgrad_accumulate="hopper_promoted", wgrad_accumulate="hopper_promoted")
    layer = QuantizedLinear(64, 64, False, "fp8_e4m3", recipe, 0, accumulate="hopper")
    assert {g: a.name for g, a in layer.accumulate.items()} == {
        "forward": "hopper", "dgrad": "hopper_promoted", "wgrad": "hopper_promoted"}  # fmt: skip


@pytest.mark.slow
def test_train_with_hopper_accumulation_logs_another_loss(cli):
    """The CLI as a user runs it: FP8 rowwise, summed as an H100 does, trains and logs; its loss is not
    the exact sums' (the same seed, the same data)."""
    exact, hopper = (cli.submit(*GPT, "precision=fp8_row", f"precision.accumulate={a}") for a in ("exact", "hopper"))
    rows = {name: run.result().check().metrics() for name, run in (("exact", exact), ("hopper", hopper))}
    losses = {name: [r["train/loss"] for r in rs if "train/loss" in r] for name, rs in rows.items()}
    assert len(losses["hopper"]) == 2 and all(torch.isfinite(torch.tensor(losses["hopper"])))
    assert losses["hopper"] != losses["exact"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("low", "high"), [(-6, 8), (-14, 15), (-100, -40), (-133, 127)], ids=["e4m3", "e5m2", "tiny-bf16", "bf16"]
)
def test_largest_exponent_by_gemm_equals_the_elementwise_maximum(seed, low, high):
    """The products' largest exponent per instruction, from one GEMM of powers (fp32 for E4M3's
    exponents, fp64 for E5M2's) or a max-reduction (bf16's, too wide for a GEMM), against the maximum
    taken product by product, a zero product counting as e_zero, above tiny products; zeros among the
    operands."""
    g = torch.Generator().manual_seed(seed)
    ea = torch.randint(low, high + 1, (M, K), generator=g, dtype=torch.int32)
    eb = torch.randint(low, high + 1, (K, N), generator=g, dtype=torch.int32)
    ea[torch.rand(M, K, generator=g) < 0.3] = acc.ZERO_EXPONENT
    eb[:, 0] = acc.ZERO_EXPONENT  # a column of zeros: every product of it zero
    got = acc.largest_exponents(ea, eb, acc.WGMMA_FP8, (low, low))
    xa, xb = ea.reshape(M, -1, 32).transpose(0, 1).unsqueeze(2), eb.reshape(-1, 32, N).transpose(1, 2).unsqueeze(1)
    zero = (xa == acc.ZERO_EXPONENT) | (xb == acc.ZERO_EXPONENT)
    expected = (xa + xb).masked_fill(zero, acc.WGMMA_FP8.e_zero).amax(-1)
    assert torch.equal(got, expected)


def test_bf16_beyond_a_gemms_exponent_range_equals_mmasim():
    """bf16 values from 2^-120 to 2^90: products from 2^-240 to 2^180."""
    g = torch.Generator().manual_seed(4)
    a, b = bf16((M, 64), g), bf16((64, N), g)
    a[0, 0], a[1, 1], b[2, 0], b[3, 1] = 2.0**90, 2.0**-120, 2.0**-120, 2.0**90
    expected = nv.WGMMA("Hopper", "m64n8k16.f32.bf16.bf16").arithmetic_op(a.bfloat16(), b.bfloat16(), torch.zeros(M, N))
    assert torch.equal(acc.matmul(a, b, acc.WGMMA_BF16), expected)


# --- the compiled steps (numerics/fdpa.py through torch.compile) compute the eager steps' bits


def operands(case, g):
    """A case's matmul arguments beyond the instruction: FP8 with zeros and cancellations, bf16 over
    a wide range, MXFP8's elements with E8M0 scales, fp8_block's factors per 128 of K."""
    if case == "bf16":
        a, b = cancelling(bf16((8, 256), g), bf16((256, 16), g))
        return a, b, {}
    a, b = cancelling(fp8((8, 512), "e4m3", g), fp8((512, 16), "e4m3", g))
    if case == "mx":
        sa = torch.exp2(torch.randint(-20, 20, (8, 16), generator=g).float())
        sb = torch.exp2(torch.randint(-20, 20, (16, 16), generator=g).float())
        return a, b, {"subnormals": (-6, -6), "scales": (sa, sb), "block": 32}
    if case == "block":
        fa, fb = torch.rand(8, 4, generator=g) + 0.5, torch.rand(4, 16, generator=g) + 0.5
        return a, b, {"subnormals": (-6, -6), "promote": 128, "factors": (fa, fb)}
    return a, b, {"subnormals": (-6, -6), "promote": 128 if case == "promoted" else None}


COMPILED = [("hopper", acc.WGMMA_FP8), ("promoted", acc.WGMMA_FP8), ("ada", acc.MMA_FP8_SM89),
            ("block", acc.WGMMA_FP8), ("bf16", acc.WGMMA_BF16), ("mx", acc.TCGEN05_MXF8F6F4)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ins"), COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_steps_equal_eager_ones(case, ins, monkeypatch):
    """Random cases, bit for bit: FP8 (Hopper's, Ada's) with and without promotion, with fp8_block's
    factors, bf16, MXFP8 with its block scales; bands of 3 rows (a ragged last one)."""
    g = torch.Generator().manual_seed(5)
    a, b, kwargs = operands(case, g)
    eager = acc.matmul(a, b, ins, compiled=False, **kwargs)
    intervals = a.shape[1] // (kwargs.get("promote") or a.shape[1])
    monkeypatch.setattr(acc, "SUMS_VALUES", 3 * b.shape[1] * intervals)
    assert torch.equal(acc.matmul(a, b, ins, compiled=True, **kwargs), eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("case", "ins"), COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_steps_on_a_gpu_equal_eager_ones_on_the_cpu(case, ins):
    g = torch.Generator().manual_seed(6)
    a, b, kwargs = operands(case, g)
    on_gpu = {k: tuple(t.cuda() for t in v) if k in ("scales", "factors") else v for k, v in kwargs.items()}
    got = acc.matmul(a.cuda(), b.cuda(), ins, compiled=True, **on_gpu)
    assert torch.equal(got.cpu(), acc.matmul(a, b, ins, compiled=False, **kwargs))


def test_the_first_steps_flop_counter_keeps_the_compiled_sums(monkeypatch):
    """Under a dispatch mode (the first step's FLOP counter) torch.compile would run its functions op by
    op, minutes for the default GPT's first step: the compiled steps still run, outside the mode, and
    give the same bits."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(7)
    a, b, kwargs = operands("hopper", g)
    eager = acc.matmul(a, b, acc.WGMMA_FP8, compiled=False, **kwargs)
    asked = []
    monkeypatch.setattr(acc, "compiled_steps", lambda: asked.append(1) or acc.EAGER)  # the same steps, uncompiled
    with FlopCounterMode(display=False):
        assert torch.equal(acc.matmul(a, b, acc.WGMMA_FP8, compiled=True, **kwargs), eager)
    assert asked
