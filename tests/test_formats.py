"""Number formats (halfprec.numerics.formats): values computed by hand on small blocks, then held
against torchao's own MX and NVFP4 quantizers on random data."""

import math

import pytest
import torch

from halfprec.numerics.formats import FORMATS, fake_quantize, quantize
from halfprec.numerics.formats.casts import nearest_cast, torchao_mx, torchao_nvfp4
from halfprec.numerics.formats.elements import ELEMENTS, split
from halfprec.numerics.formats.hadamard import hadamard, random_hadamard, rotate
from halfprec.numerics.formats.scales import e8m0, e8m0_by_powers


def block(*values: float, size: int = 32) -> torch.Tensor:
    """One block of `size` values: the given ones, then zeros (which change no block's amax)."""
    return torch.tensor([*values, *[0.0] * (size - len(values))])


def test_the_element_grids_are_those_of_the_definitions():
    assert ELEMENTS["e2m1"].grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e2m3, e3m2 = ELEMENTS["e2m3"].grid, ELEMENTS["e3m2"].grid
    assert (e2m3[1].item(), e2m3[-1].item(), len(e2m3)) == (0.125, 7.5, 32)  # subnormal step 1/8
    assert (e3m2[1].item(), e3m2[-1].item(), len(e3m2)) == (0.0625, 28.0, 32)
    e4m3 = ELEMENTS["e4m3"].grid
    assert (e4m3[1].item(), e4m3[8].item(), e4m3[-1].item()) == (2**-9, 2**-6, 448.0)  # subnormal, normal, max
    assert ELEMENTS["e5m2"].grid[-1].item() == 57344.0
    emax = {"e2m1": 2, "e2m3": 2, "e3m2": 4, "e4m3": 8, "e5m2": 15, "int8": 0}  # INT8: 127/64 < 2 = 2^1
    assert {name: ELEMENTS[name].emax for name in emax} == emax


@pytest.mark.parametrize("name", list(ELEMENTS))
def test_every_registered_element_has_a_grid_from_zero_to_its_max_and_the_emax_of_its_max(name):
    """What the scales and the rounding rely on, for every element of the registry (a new one too):
    an ascending grid from 0 to `max`, `max` below 2^(emax + 1), and rounding onto the grid."""
    element = ELEMENTS[name]
    grid = element.grid
    assert grid[0].item() == 0 and grid[-1].item() == element.max and bool((grid[1:] > grid[:-1]).all())
    assert 2.0**element.emax <= max(element.max, 1) < 2.0 ** (element.emax + 1)
    mids = (grid[1:] + grid[:-1]) / 2
    assert torch.equal(element.nearest(grid.clone()), grid)
    assert bool((element.nearest(torch.nextafter(mids, mids + 1)) == grid[1:]).all())


def test_the_int8_grid_is_k_over_64_for_k_in_minus_127_to_127():
    int8 = ELEMENTS["int8"]
    assert torch.equal(int8.grid, torch.arange(128) / 64)  # 0, 1/64, ..., 127/64: one step, 2^-6, throughout
    assert (int8.grid[1].item(), int8.grid[-1].item(), int8.bits) == (0.015625, 1.984375, 8)
    signed = torch.cat([-int8.grid, int8.grid]).unique()  # -0 and 0 are one value
    assert len(signed) == 255 and signed[0].item() == -1.984375  # symmetric: -2 (code -128) is not used
    assert int8.nearest(torch.tensor([-2.0, -1.99])).tolist() == [-1.984375, -1.984375]


def test_int8_rounds_to_the_nearest_multiple_of_1_64_with_ties_to_even():
    """The arithmetic (a constant spacing below 2^emin) against the definition: of the 255 values
    k/64, the nearest, a tie going to the even k."""
    int8, codes = ELEMENTS["int8"], torch.arange(-127, 128)
    mids = (torch.arange(-127, 127) + 0.5) / 64
    wide = torch.empty(5000).uniform_(-2.5, 2.5, generator=torch.Generator().manual_seed(0))
    x = torch.cat([codes / 64, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), wide])
    distance = (x[:, None] - codes / 64).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values  # one code, or two at a tie
    pick = torch.where((nearest & (codes % 2 == 0)).any(dim=1, keepdim=True), nearest & (codes % 2 == 0), nearest)
    expected = codes[pick.int().argmax(dim=1)] / 64
    assert torch.equal(int8.nearest(x.clone()), expected)


def test_bits_per_value_count_the_block_scales():
    bits = {name: f.bits for name, f in FORMATS.items()}
    assert (bits["mxfp8"], bits["mxfp6_e2m3"], bits["mxfp4"], bits["nvfp4"], bits["fp8_block"]) == (
        8.25, 6.25, 4.25, 4.5, 8.25,
    )  # fmt: skip
    assert bits["mxint8"] == 8 + 8 / 32  # an INT8 per value, an E8M0 per 32


def test_mxfp4_rounds_to_the_nearest_e2m1_value_with_ties_to_even():
    # amax 6: scale 2^(floor(log2 6) - 2) = 1, so the elements are the values themselves
    x = block(6.0, 0.1, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.74, -2.9)
    expected = block(6.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -3.0)
    assert torch.equal(fake_quantize(x, "mxfp4"), expected)


@pytest.mark.parametrize("name", ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"])
def test_rounding_to_nearest_is_the_libraries_cast_bit_for_bit(name):
    """halfprec rounds by arithmetic (faster); the casts of torch (float8 dtypes) and torchao (4 and
    6 bits) are the definition: every value, every midpoint and its neighbours, subnormals, values
    past the largest, and random magnitudes across the range."""
    element = ELEMENTS[name]
    grid = element.grid
    mids = (grid[1:] + grid[:-1]) / 2
    wide = torch.exp2(
        torch.empty(20_000).uniform_(-30, math.log2(element.max) + 2, generator=torch.Generator().manual_seed(0))
    )
    near = [grid, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), grid * 1.25, wide]
    x = torch.cat([*near, torch.tensor([element.max * 1.01, element.max * 100, 1e-30, 0.0])])
    x = torch.cat([x, -x])
    if name in ("e4m3", "e5m2"):
        dtype = torch.float8_e4m3fn if name == "e4m3" else torch.float8_e5m2
        expected = x.clamp(-element.max, element.max).to(dtype).float()
    else:
        expected = nearest_cast(name)(x)
    for got in (element.nearest(x.clone()), element.nearest_by_splitting(x.clone())):  # eager; compiled on a CPU
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_veltkamps_splitting_rounds_every_fp32_to_nearest_with_ties_to_even(bits):
    """elements.split against the exponent-bit arithmetic on every fp32 in [1, 4) (the splitting is
    the same in every binade while nothing overflows): the compiled CPU quantizer rounds with it."""
    x = torch.arange(0x3F800000, 0x40800000, dtype=torch.int32).view(torch.float32)
    step = 2.0 ** (1 - bits) * torch.where(x < 2, 1.0, 2.0)
    assert torch.equal(split(x, bits), x.div(step).round().mul(step))


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_e8m0_scales_in_float_arithmetic_are_the_exponent_bits_ones(rule):
    """scales.e8m0_by_powers (the compiled CPU quantizer's) against frexp's, where they could part:
    every power of two from 2^-149 to 2^127 and its neighbours (subnormal and huge amax included)."""
    powers = torch.ldexp(torch.ones(277), torch.arange(-149, 128))
    amax = torch.cat([powers, torch.nextafter(powers, powers * 2), torch.nextafter(powers, powers * 0), torch.zeros(1)])
    amax = torch.cat([amax, amax * 1.5, torch.tensor([torch.finfo(torch.float32).max])]).clamp(max=3.4e38)
    for element in ELEMENTS.values():
        assert torch.equal(e8m0_by_powers(amax, element, rule), e8m0(amax, element, rule)), element.name


@pytest.mark.parametrize(
    "values, floor, rceil",
    [
        ([7.0], [6.0], [8.0]),  # floor: scale 2^(2 - 2) = 1, 7 saturates to 6; rceil: 2^ceil(log2 7/6) = 2, 3.5 -> 4
        ([12.0], [12.0], [12.0]),  # scale 2 both ways: 6 exactly
        ([0.3], [0.25], [0.25]),  # scale 2^(-2 - 2) = 1/16 both ways: 4.8 -> 4
        ([448.0, 1.0], [384.0, 0.0], [512.0, 0.0]),  # floor 2^(8-2): 7 -> 6; rceil 2^7: 3.5 -> 4; 1 -> 0
    ],
)
def test_a_blocks_e8m0_scale_comes_from_its_amax(values, floor, rceil):
    x = block(*values)
    assert fake_quantize(x, "mxfp4")[: len(values)].tolist() == floor
    assert fake_quantize(x, "mxfp4", scale_rule="rceil")[: len(values)].tolist() == rceil


def test_mxint8_rounds_each_value_to_a_multiple_of_its_blocks_scale_over_64():
    # amax 3: scale 2^(floor(log2 3) - 0) = 2, so the values are k/64 * 2 = k/32
    x = block(3.0, -1.0, 0.1, 1 / 3, 2.5 / 32, -2.5 / 32, 3.5 / 32)
    # 3 -> k 96 and -1 -> k -32, exact; 0.1 * 32 = 3.2 -> 3; (1/3) * 32 = 10.67 -> 11;
    # the ties 2.5 and -2.5 go to the even 2 and -2 (away from zero would give 3), 3.5 to 4
    expected = block(3.0, -1.0, 3 / 32, 11 / 32, 2 / 32, -2 / 32, 4 / 32)
    assert torch.equal(fake_quantize(x, "mxint8"), expected)


def test_mxint8_saturates_at_127_64_times_the_scale():
    # amax 3.99: floor(log2 3.99) = 1, scale 2; 3.99 / 2 * 64 = 127.68 -> 128, past the largest code:
    # 127 * 2/64 = 3.96875, either sign (-128, -2 * scale, is not used); 1 / 2 * 64 = 32 is exact
    x = block(3.99, -3.99, 1.0)
    assert fake_quantize(x, "mxint8")[:3].tolist() == [3.96875, -3.96875, 1.0]
    # rceil: 2^ceil(log2(3.99 / (127/64))) = 2^ceil(1.008) = 4, so 3.99 / 4 * 64 = 63.84 -> 64: 4.0
    assert fake_quantize(x, "mxint8", scale_rule="rceil")[:3].tolist() == [4.0, -4.0, 1.0]


def test_each_block_has_its_own_scale_and_blocks_run_along_the_axis():
    x = torch.cat([block(6.0, 1.25), block(0.75, 0.3)])  # the second block: scale 1/8, 0.3 -> 2.4 -> 2
    assert fake_quantize(x, "mxfp4")[[0, 1, 32, 33]].tolist() == [6.0, 1.0, 0.75, 0.25]
    m = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fake_quantize(m, "mxfp8", axis=0), fake_quantize(m.T, "mxfp8").T)
    assert torch.equal(fake_quantize(m[:, 32:40], "mxfp4"), fake_quantize(m[:, :40], "mxfp4")[:, 32:40])  # padded


def test_nvfp4_has_two_levels_of_scale():
    # tensor amax 6 * 448 = 2688: the tensor scale is 1; a block with amax 0.9 has the block scale
    # 0.9 / 6 = 0.15, whose nearest E4M3 value is 1.25 * 2^-3 = 0.15625 (1.125 * 2^-3 is 0.140625)
    x = torch.cat([block(2688.0, size=16), block(0.9, 0.3, size=16), block(6.0, 2.5, size=16)])
    q = fake_quantize(x, "nvfp4")
    assert q[0].item() == 2688.0  # block scale 448
    assert (q[16].item(), q[17].item()) == (6 * 0.15625, 2 * 0.15625)  # 5.76 -> 6, 1.92 -> 2
    assert (q[32].item(), q[33].item()) == (6.0, 2.0)  # block scale 1: 2.5 ties to even 2


def test_fp8_scales_are_fp32_per_tensor_per_row_or_per_block():
    x = torch.tensor([[896.0, 3.0, 1.0, 0.0005], [1.0, 0.5, 0.25, 0.0]])
    # per tensor: scale 896 / 448 = 2; 0.0005 / 2 is below half of E4M3's smallest subnormal 2^-9
    assert fake_quantize(x, "fp8_e4m3").tolist() == [[896.0, 3.0, 1.0, 0.0], [1.0, 0.5, 0.25, 0.0]]
    # per row: the second row's scale is 1 / 448, so 0.25 -> 112, exact
    assert fake_quantize(x, "fp8_e4m3_row")[1].tolist() == [1.0, 0.5, 0.25, 0.0]
    # e5m2, scale 896 / 57344 = 1/64: 3 * 64 = 192 and 64 are exact with 2 mantissa bits
    assert fake_quantize(x, "fp8_e5m2")[0, :3].tolist() == [896.0, 3.0, 1.0]
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    w[0, 0] = 100.0  # one outlier: only its 1x128 block, or its 128x128 tile, gets the large scale
    rows, tiles = fake_quantize(w, "fp8_block"), fake_quantize(w, "fp8_block", tile=True)
    assert torch.equal(rows[1:], fake_quantize(w[1:], "fp8_block"))
    assert torch.equal(rows[0, 128:], fake_quantize(w[0, 128:], "fp8_block"))
    assert torch.equal(tiles[128:], fake_quantize(w[128:], "fp8_block", tile=True))


def test_square_blocks_give_a_weight_the_same_values_whichever_axis_a_gemm_contracts():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fake_quantize(w, "nvfp4", tile=True), fake_quantize(w, "nvfp4", axis=0, tile=True))
    assert not torch.equal(fake_quantize(w, "nvfp4"), fake_quantize(w, "nvfp4", axis=0))


def test_zero_blocks_subnormals_and_saturation():
    assert torch.equal(fake_quantize(torch.zeros(64), "mxfp8"), torch.zeros(64))
    assert torch.equal(fake_quantize(torch.zeros(32), "nvfp4"), torch.zeros(32))
    assert torch.equal(fake_quantize(torch.zeros(64), "mxint8"), torch.zeros(64))
    tiny = 2.0**-130  # an fp32 subnormal: E8M0's smallest scale 2^-127 takes it to 1/8, exact in E4M3
    assert fake_quantize(block(tiny), "mxfp8")[0].item() == tiny
    assert fake_quantize(block(6.0, 0.5), "mxfp4")[1].item() == 0.5  # E2M1's subnormal
    assert fake_quantize(block(500.0, 1.0), "mxfp8")[0].item() == 448.0  # floor: scale 1, 500 saturates


def test_a_block_with_inf_or_nan_is_nan_and_the_others_are_untouched():
    for bad in (math.inf, -math.inf, math.nan):
        x = torch.cat([block(1.0, bad), block(1.0, 0.5)])
        for name in ("mxfp4", "mxfp8", "mxint8", "nvfp4", "fp8_e4m3_row"):
            q = fake_quantize(x.reshape(2, 32), name)
            span = 16 if name == "nvfp4" else 32  # the values that share the bad one's scale
            assert q[0, :span].isnan().all() and not q[0, span:].isnan().any(), (name, bad)
            assert q[1, :2].tolist() == [1.0, 0.5], (name, bad)


@pytest.mark.parametrize(
    "name, top, lo, hi",
    [
        ("mxfp4", 6.0, 0.0, 0.5),  # amax 6: scale 1; 0.3 lies between 0 and 0.5: up with probability 0.6
        ("mxint8", 1.0, 19 / 64, 20 / 64),  # amax 1: scale 2^(0 - 0) = 1; 0.3 * 64 = 19.2: up with probability 0.2
    ],
)
def test_stochastic_rounding_is_unbiased_seeded_and_lands_on_neighbours(name, top, lo, hi):
    x = block(top, *[0.3] * 31).repeat(4000, 1)
    q = fake_quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    values = q[:, 1:]
    assert set(values.unique().tolist()) == {lo, hi}
    p = (0.3 - lo) / (hi - lo)
    n, sigma = values.numel(), (hi - lo) * math.sqrt(p * (1 - p))
    assert abs(values.mean().item() - 0.3) < 3 * sigma / math.sqrt(n)
    again = fake_quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(q, again) and torch.equal(q[:, 0], torch.full((4000,), top))  # grid values stay


def test_stochastic_rounding_is_unbiased_over_random_values():
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(3))
    q = fake_quantize(x, "nvfp4", rounding="stochastic", generator=torch.Generator().manual_seed(4))
    nearest = fake_quantize(x, "nvfp4")
    err = (q - x).mean().item()
    assert abs(err) < 3 * (q - x).std().item() / math.sqrt(x.numel())
    assert (q - x).abs().mean() > (nearest - x).abs().mean()  # unbiased, at the price of larger errors


@pytest.mark.parametrize("name, element", [("mxfp8", "e4m3"), ("mxfp8_e5m2", "e5m2"), ("mxfp6_e2m3", "e2m3"),
                                           ("mxfp6_e3m2", "e3m2"), ("mxfp4", "e2m1")])  # fmt: skip
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_the_mx_formats_equal_torchaos_quantizer(name, element, rule):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g) * torch.exp(2 * torch.randn(64, 1, generator=g))  # rows of all sizes
    assert torch.equal(fake_quantize(x, name, scale_rule=rule), torchao_mx(x, element, 32, rule))


MX_FORMATS = [name for name, f in FORMATS.items() if f.scale == "e8m0"]
FP32_MAX = torch.finfo(torch.float32).max


def largest_finite_value(name: str) -> float:
    """The format's largest value fp32 holds: an element of its grid times a power of two, below 2^128
    (float64 products: exact)."""
    products = FORMATS[name].element.grid.double()[1:, None] * 2.0 ** torch.arange(100, 128).double()
    return products[products < 2.0**128].max().item()


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("name", MX_FORMATS)
def test_fp32s_largest_value_stays_finite_under_either_scale_rule(name, rule):
    """rceil's scale for a block holding fp32's largest value (E4M3: 2^120) makes it 255.99, which
    rounds to 256: 2^128, past fp32. It saturates instead, at the format's largest finite value."""
    q = quantize(block(FP32_MAX, -FP32_MAX, 1.0), name, scale_rule=rule, count_saturated=True)
    assert q.values.isfinite().all()
    if rule == "rceil":
        top = largest_finite_value(name)
        assert q.values[:3].tolist() == [top, -top, 0.0]
        assert q.saturated.item() == (2 if top < FP32_MAX else 0)  # nothing past mxint8's 127/64 * 2^127


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("name", [n for n in MX_FORMATS if n != "mxint8"])
def test_blocks_near_fp32s_largest_value_saturate_where_torchao_overflows(name, rule):
    """torchao's quantizer, but its infinities (rceil's values past the format's largest finite one):
    that value; every other value the same, bit for bit. floor's scales already saturate there."""
    g = torch.Generator().manual_seed(8)
    x = FP32_MAX * (1 - torch.rand(16, 32, generator=g) ** 4 * torch.logspace(-8, 0, 16)[:, None])
    x = x * torch.randn(16, 32, generator=g).sign()
    reference = torchao_mx(x, FORMATS[name].element.name, 32, rule)
    assert reference.isinf().any() == (rule == "rceil")  # the edge case is there
    expected = torch.where(reference.isinf(), largest_finite_value(name) * reference.sign(), reference)
    for rounding in ("nearest", "stochastic"):
        q = fake_quantize(x, name, rounding=rounding, scale_rule=rule, generator=torch.Generator().manual_seed(0))
        assert q.isfinite().all()
        if rounding == "nearest":
            assert torch.equal(q, expected)


def test_nvfp4_equals_torchaos_quantizer():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    assert torch.equal(fake_quantize(x, "nvfp4"), torchao_nvfp4(x, x.abs().max() / (6 * 448)))


def test_shape_and_dtype_are_kept_and_bad_arguments_are_one_line():
    x = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    q = fake_quantize(x, "mxfp8", axis=1)
    assert q.shape == x.shape and q.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no number format 'mxfp3': the formats are fp8_e4m3, "):
        fake_quantize(x, "mxfp3")
    with pytest.raises(ValueError, match="mxfp4 has no square blocks"):
        fake_quantize(x, "mxfp4", tile=True)
    with pytest.raises(ValueError, match="scale_rule='rceil': floor or rceil, for the MX formats"):
        fake_quantize(x, "nvfp4", scale_rule="rceil")
    with pytest.raises(ValueError, match="rounding='up'"):
        fake_quantize(x, "nvfp4", rounding="up")


def test_the_random_hadamard_transform_is_orthogonal_and_leaves_a_gemm_unchanged():
    h = hadamard(16)
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25))
    assert torch.allclose(h @ h.T, torch.eye(16), atol=1e-6)
    g = torch.Generator().manual_seed(7)
    q = random_hadamard(16, g)
    assert torch.allclose(q @ q.T, torch.eye(16), atol=1e-6) and not torch.equal(q, h)
    dy, x = torch.randn(64, 8, generator=g), torch.randn(64, 12, generator=g)  # dW = dy^T x, over 64 tokens
    dw = rotate(dy, q, axis=0).T @ rotate(x, q, axis=0)
    assert torch.allclose(dw, dy.T @ x, atol=1e-5)
    with pytest.raises(ValueError, match="a multiple of 16"):
        rotate(torch.zeros(40, 3), q, axis=0)


@pytest.mark.parametrize("name", list(FORMATS))
def test_bf16_holds_every_gemm_operand_value(name):
    """What lets a layer's GEMMs take bf16 operands on a GPU (quantized.gemm): every value an MX format
    gives, over magnitudes from 1e-30 to 1e30, survives a cast to bf16, and so does every value of
    NVFP4 and the fp8 formats with their fp32 scales split off (the GEMM applies them to its output,
    per tensor, row or 128-long chunk); with them, element x scale is a number bf16 rounds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g) * torch.logspace(-30, 30, 4096)
    fmt = FORMATS[name]
    for rounding in ("nearest", "stochastic"):
        q = quantize(x, name, rounding=rounding, generator=g, split=True)
        assert (q.factor is None) == (fmt.factor is None)
        assert torch.equal(q.values.bfloat16().float(), q.values) and fmt.exact_in_bf16
        whole = fake_quantize(x, name, rounding=rounding, generator=g)
        assert torch.equal(whole.bfloat16().float(), whole) == (fmt.scale == "e8m0"), (name, rounding)
