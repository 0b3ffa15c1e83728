"""model=gpt2 and model=llama, the GPT code at other settings: rotary position embeddings by hand,
the parameter counts at the default sizes, tiny versions trained in the FP4 formats, the errors; the
parameter count and the CPU warning a run starts with. (Their logits against the papers' definitions:
test_gpt_reference.py.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl
from test_resume import without_perf

from halfprec.components.models import create_model
from halfprec.components.models import gpt as gpt_module
from halfprec.components.models.gpt import Rotary, create_gpt
from halfprec.config import from_saved, saved
from halfprec.errors import ConfigError
from halfprec.numerics.quantized import QuantizedLinear
from halfprec.training.build import build
from halfprec.training.checkpoint import check_resume_config
from halfprec.training.perf import model_lines
from halfprec.training.run import run

from helpers import TRAIN, compose_cfg, typed_cfg

# A LLaMA small enough for a test: 2 blocks of width 32 (heads of 16 values), a 32-token context;
# validation on 1% of the corpus (a few topics): a tenth's 360 micro-batches were most of the time.
TINY_LLAMA = ["task=lm", "model=llama", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
              "data.batch_size=4", "data.val_fraction=0.01", "trainer.val_every=0", "trainer.log_every=1"]  # fmt: skip
GPT2_VOCABULARY = 50257


def test_rope_rotates_each_pair_of_a_head_by_its_position_times_its_frequency():
    """Head size 4, base 100: the pairs (x0, x2) and (x1, x3) turn by p and p/10 radians at position p."""
    rope = Rotary(head=4, block_size=5, base=100.0)
    e0, e1 = torch.eye(4)[0], torch.eye(4)[1]
    x = torch.stack([e0, e1]).view(2, 1, 1, 4).expand(2, 1, 5, 4)  # (batch 2, 1 head, 5 positions, 4)
    out = rope(x)
    for p in range(5):
        a, b = p * 1.0, p * 100 ** (-2 / 4)
        expected = torch.tensor([[math.cos(a), 0, math.sin(a), 0], [0, math.cos(b), 0, math.sin(b)]])
        torch.testing.assert_close(out[:, 0, p], expected)
    assert torch.equal(out[:, :, 0], x[:, :, 0])  # position 0: no rotation


def test_rope_is_a_rotation_so_q_dot_k_depends_on_the_relative_position_alone():
    """One query and one key at every position: after RoPE the logit q_i.k_j is a function of i - j
    (each diagonal of the matrix constant), and every vector keeps its length."""
    torch.manual_seed(0)
    rope = Rotary(head=8, block_size=12, base=10000.0)
    q, k = torch.randn(8).expand(1, 1, 12, 8), torch.randn(8).expand(1, 1, 12, 8)
    qr, kr = rope(q), rope(k)
    logits = (qr @ kr.transpose(-2, -1))[0, 0]
    torch.testing.assert_close(logits[1:, 1:], logits[:-1, :-1], rtol=0, atol=1e-5)  # shifted by one position
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(logits[0], logits[0, 0].expand(12))  # yet the logits do see the distance


def test_attention_logits_of_a_shifted_sequence_are_the_same(monkeypatch):
    """The LLaMA attention (qk-norm on, RoPE after it) on a sequence and on the same sequence moved
    5 positions later: the queries and keys differ, their products among the sequence's tokens do not."""
    seen = []

    def keep_qk(q, k, v, **kwargs):
        seen.append((q, k))
        return torch.zeros_like(q)

    monkeypatch.setattr(gpt_module.F, "scaled_dot_product_attention", keep_qk)
    torch.manual_seed(0)
    attn = create_gpt((16,), 32, n_layer=1, n_head=2, n_embd=16, block_size=16, pos="rope", qk_norm=True,
                      norm="rmsnorm", mlp="swiglu").blocks[0].attn  # fmt: skip
    x = torch.randn(1, 8, 16)
    attn(x)
    attn(torch.cat([torch.randn(1, 5, 16), x], dim=1))  # 5 other tokens first
    (q, k), (q_shifted, k_shifted) = seen[0], (t[:, :, 5:] for t in seen[1])
    assert not torch.allclose(q, q_shifted)
    torch.testing.assert_close(q_shifted @ k_shifted.transpose(-2, -1), q @ k.transpose(-2, -1), rtol=0, atol=1e-5)


def test_rope_computes_in_fp32_and_returns_the_dtype_it_was_given():
    """Under autocast (or a pure bf16 mode) q and k stay bf16 for the attention, rounded once."""
    rope = Rotary(head=8, block_size=4, base=10000.0)
    x = torch.randn(2, 2, 4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rope(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, rope(x.float()).bfloat16())
    assert rope(x.float()).dtype == torch.float32


def parameters_at_default_size(*overrides: str) -> int:
    """Built on the meta device: shapes without memory; tied weights counted once."""
    cfg = typed_cfg("task=lm", *overrides)
    with torch.device("meta"):
        model = create_model(cfg.model, (cfg.model.args["block_size"],), GPT2_VOCABULARY)
    return sum(p.numel() for p in model.parameters())


def test_gpt2_and_llama_have_their_papers_parameter_counts_at_the_default_size():
    embedding, positions, width = GPT2_VOCABULARY * 768, 1024 * 768, 768
    attention = 4 * width * width  # qkv and the output projection
    gelu_mlp = 2 * width * 4 * width
    swiglu_mlp = 3 * width * 2048  # fc, gate and proj; 2048 = 8/3 x 768, a multiple of 16
    norms = 2 * width  # per block: a gain each
    biases = 3 * width + width + 4 * width + width + norms  # GPT-2's: qkv, proj, fc, proj, the LayerNorms'
    gpt2 = embedding + positions + 12 * (attention + gelu_mlp + norms + biases) + 2 * width  # the last norm's bias
    llama = embedding + 12 * (attention + swiglu_mlp + norms) + width
    assert (gpt2, llama) == (124_439_808, 123_551_232)  # GPT-2 small's count with its tied head
    assert parameters_at_default_size("model=gpt2") == gpt2
    assert parameters_at_default_size("model=gpt2", "model.bias=false") == gpt2 - 12 * biases - width == 124_337_664
    assert parameters_at_default_size("model=llama") == llama
    assert parameters_at_default_size("model=llama", "model.tie_embeddings=false") == llama + embedding


def test_a_gpt_checkpoint_keeps_its_keys_and_rope_adds_none():
    """model=gpt's state dict is what it was before pos and tie_embeddings (its checkpoints load);
    RoPE's cos and sin are no keys (computed at build), and an untied head is a key of its own."""
    common = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}
    block = ["norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight", "mlp.fc.weight", "mlp.proj.weight"]
    gpt = create_gpt((8,), 32, **common)
    assert list(gpt.state_dict()) == ["wte.weight", "wpe.weight", *[f"blocks.0.{k}" for k in block], "norm.weight",
                                      "lm_head.weight"]  # fmt: skip
    llama = create_gpt((8,), 32, **common, pos="rope", mlp="swiglu", norm="rmsnorm", tie_embeddings=False)
    keys = list(llama.state_dict())
    assert "wpe.weight" not in keys and not any("rope" in k for k in keys) and "blocks.0.mlp.gate.weight" in keys
    assert llama.lm_head.weight is not llama.wte.weight
    assert all(block.attn.rope is llama.rope for block in llama.blocks)  # one cos/sin table for the model


def first_row(run_dir) -> dict:
    return read_jsonl(run_dir / "metrics.jsonl")[0]


def test_a_tiny_llama_trains_in_nvfp4_with_its_last_block_high_and_resumes(tmp_path, capsys):
    """Block 0's five layers (the SwiGLU gate among them) in NVFP4 with the whole recipe (stochastic
    gradients: the resumed run must draw what the straight one did), block 1 and the head high.
    The FLOP counter, on each run's first step, must run SiLU's backward as the kernel, not as a
    decomposition a last bit apart, or the resumed run's first step would not be the straight one's."""
    nvfp4 = [*TINY_LLAMA, "precision=nvfp4", "precision.high_last=1", "sched.warmup_steps=1", "sched.total_steps=4",
             "trainer.ckpt_every=2", "trainer.val_every=2"]  # fmt: skip
    run(compose_cfg(*nvfp4, "trainer.max_steps=4"), tmp_path / "straight")
    first = first_row(tmp_path / "straight")
    assert (first["precision/layers/nvfp4"], first["precision/layers/high"]) == (5, 6)
    plan = "layers: nvfp4    5  blocks.0.attn.qkv, blocks.0.attn.proj, blocks.0.mlp.fc, blocks.0.mlp.gate, +1 more"
    assert plan in capsys.readouterr().err.splitlines()
    run(compose_cfg(*nvfp4, "trainer.max_steps=2"), tmp_path / "parts")
    run(compose_cfg(*nvfp4, "trainer.max_steps=4", "resume=auto"), tmp_path / "parts")
    straight, parts = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("straight", "parts"))
    assert without_perf(parts) == without_perf(straight)
    losses = [r["train/loss"] for r in straight if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_an_untied_llama_trains_in_mxfp4_with_a_rule_and_keeps_its_head_high(tmp_path):
    """The attention in MXFP8 by a rule, the MLPs (fc, gate, proj) in MXFP4, the untied head high."""
    rule = "precision.rules=[{match: '*.attn.*', format: mxfp8}]"
    overrides = [*TINY_LLAMA, "precision=mxfp4", rule, "model.tie_embeddings=false", "trainer.max_steps=3"]
    model = build(compose_cfg(*overrides)).model
    assert model.lm_head.weight is not model.wte.weight and not isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.blocks[1].mlp.gate, QuantizedLinear) and model.blocks[1].mlp.gate.format == "mxfp4"
    run(compose_cfg(*overrides), tmp_path)
    first = first_row(tmp_path)
    assert [first[f"precision/layers/{f}"] for f in ("mxfp8", "mxfp4", "high")] == [4, 6, 1]
    assert all(math.isfinite(r["train/loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r)


def test_a_head_size_rope_cannot_rotate_is_one_line_naming_n_head_and_what_works():
    with pytest.raises(ConfigError) as info:
        build(compose_cfg(*TINY_LLAMA, "model.n_embd=30"))  # 2 heads of 15 values
    assert str(info.value) == (
        "model.n_head=2: gives heads of 15 values (model.n_embd=30) and pos=rope rotates pairs of them: "
        "use model.n_head=1 or 3 or 5"
    )
    with pytest.raises(ConfigError, match=r"^model.n_head=1: gives heads of 15 values .* use an even model.n_embd$"):
        create_gpt((8,), 32, n_head=1, n_embd=15, block_size=8, pos="rope")


def test_a_gpt_checkpoint_from_before_the_variants_resumes_as_the_learned_tied_gpt_it_was(tmp_path):
    """Checkpoints from before model.pos, rope_base, tie_embeddings, norm_eps and bias (and
    data.dtype) were of GPTs with learned positions, a tied head, torch's eps and no biases: one
    resumes as that model, not as a rotary one or one with biases; a model without those keys (the
    MLP) is not held to them; precision.quantizer changes no value."""
    new = typed_cfg("task=lm")
    added = ("pos", "rope_base", "tie_embeddings", "norm_eps", "bias")
    tree = saved(new)
    old = from_saved({**tree, "model": {k: v for k, v in tree["model"].items() if k not in added}})
    assert check_resume_config(old, new, Path("step-00000004.pt")) == []
    rope = typed_cfg("task=lm", "model.pos=rope")
    with pytest.raises(ConfigError, match=r"model.pos=rope: .* was trained with model.pos='learned'"):
        check_resume_config(old, rope, Path("step-00000004.pt"))
    with pytest.raises(ConfigError, match=r"^model.bias=true: .* was trained with model.bias=False"):
        check_resume_config(old, typed_cfg("task=lm", "model.bias=true"), Path("step-00000004.pt"))
    compiled = typed_cfg("task=lm", "precision=mxfp8", "precision.quantizer=compiled")
    eager = typed_cfg("task=lm", "precision=mxfp8")
    assert check_resume_config(eager, compiled, Path("s.pt")) == ["precision.quantizer: 'auto' -> 'compiled' (allowed)"]


def test_a_run_says_its_parameter_count_first_and_keeps_it_in_summary_json(tmp_path, capsys):
    """Counted once per tensor: a tied head is the embedding's matrix, not a second one."""
    for tied in (True, False):
        run_dir = tmp_path / f"tied_{tied}"
        run(compose_cfg(*TINY_LLAMA, "trainer.max_steps=1", f"model.tie_embeddings={tied}"), run_dir)
        weights = torch.load(run_dir / "checkpoints/step-00000001.pt", weights_only=False)["model"]
        expected = sum(t.numel() for key, t in weights.items() if not (tied and key == "lm_head.weight"))
        lines = capsys.readouterr().err.splitlines()
        assert lines[:2] == [f"run dir: {run_dir}", f"model: gpt, {expected:,} parameters"]
        assert json.loads((run_dir / "summary.json").read_text())["params"] == expected


def test_on_a_cpu_a_long_step_is_said_before_it_with_what_makes_it_shorter():
    """model=gpt2 at task=lm's batch (16 sequences of 1024 bytes) is a step of about 8 TFLOP."""
    cfg = typed_cfg("task=lm", "model=gpt2")
    with torch.device("meta"):
        model = create_model(cfg.model, (1024,), 256)
    params = sum(p.numel() for p in model.parameters())
    lines = model_lines(cfg, model, (1024,), "cpu")
    assert lines[0] == f"model: gpt, {params:,} parameters"
    tflop = 6 * params * cfg.data.batch_size * 1024 / 1e12
    assert lines[1].startswith(f"warning: a step is about {tflop:.1f} TFLOP (6 x {params:,} parameters x 16,384 tokens")
    assert "data.batch_size=1" in lines[1] and len(lines) == 2
    assert model_lines(cfg, model, (1024,), "cuda") == lines[:1]
    assert model_lines(typed_cfg("task=lm", "model=gpt2", "data.batch_size=1"), model, (1024,), "cpu") == lines[:1]
    small = typed_cfg("task=lm")  # model=gpt: 0.01 TFLOP a step
    with torch.device("meta"):
        gpt = create_model(small.model, (128,), 256)
    assert len(model_lines(small, gpt, (128,), "cpu")) == 1


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_a_gpt_preset_without_task_lm_is_one_line_that_adds_task_lm(preset, tmp_path):
    """python train.py model=gpt2: the preset's name (not its arch, gpt) and the task that fits it."""
    result = subprocess.run([sys.executable, str(TRAIN), f"model={preset}"], cwd=tmp_path, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model={preset}: reads token sequences, and data=digits gives images or vectors: ")
    assert line.endswith(": add task=lm (or, for data=digits, model=fixup_resnet, mlp or timm)")
