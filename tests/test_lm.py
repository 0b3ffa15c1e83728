"""Language modelling (task=lm): the loss and z-loss by hand, the GPT, the corpora, the CLI, resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import read_jsonl
from test_resume import without_perf

from halfprec.components.data.batches import IGNORE_LABEL, eval_batches
from halfprec.components.data.text import load_pydoc, load_text, load_tokens
from halfprec.components.models.gpt import GPT, create_gpt
from halfprec.components.tasks.lm import LanguageModelling
from halfprec.errors import ConfigError
from halfprec.training.run import run

from helpers import build_from, compose_cfg, flat_params, step

# A GPT small enough for a test: 1 block of width 16, a 16-token context.
TINY = ["task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
        "data.batch_size=4", "trainer.max_steps=4", "trainer.val_every=0", "trainer.log_every=1"]  # fmt: skip


def test_the_loss_is_next_token_cross_entropy_and_the_z_loss_adds_log_z_squared():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # (batch 1, time 2, vocabulary 3)
    targets = torch.tensor([[0, 2]])
    log_z = [math.log(math.exp(2) + 1 + math.exp(-1)), math.log(2 * math.exp(0.5) + 1)]
    by_hand = ((log_z[0] - 2.0) + (log_z[1] - 0.0)) / 2  # -log p(target), mean over the 2 tokens
    assert LanguageModelling().loss(logits, targets).item() == pytest.approx(by_hand, rel=1e-6)
    z = LanguageModelling(z_loss=1e-2).loss(logits, targets).item()
    assert z == pytest.approx(by_hand + 1e-2 * (log_z[0] ** 2 + log_z[1] ** 2) / 2, rel=1e-6)
    assert (
        LanguageModelling().loss(logits.half(), targets).dtype == torch.float32
    )  # fp32 whatever the model computed in


def test_the_evaluator_counts_tokens_and_reports_bits_per_byte():
    task = LanguageModelling()
    data = load_pydoc(block_size=8)
    evaluator = task.evaluator(torch.device("cpu"), data)
    uniform = torch.zeros(2, 8, 256)  # every byte equally likely: ln 256 nats, 8 bits per byte
    targets = torch.randint(0, 256, (2, 8))
    targets[1, 4:] = IGNORE_LABEL  # padding counts for nothing
    evaluator.add(uniform, targets)
    metrics = evaluator.metrics(evaluator.sums().tolist(), n=2)
    assert evaluator.tokens.item() == 12
    assert metrics["val/loss"] == pytest.approx(math.log(256))
    assert metrics["val/bpb"] == pytest.approx(8.0) and metrics["val/ppl"] == pytest.approx(256.0)


def test_accumulation_averages_over_the_windows_tokens():
    """fp32: accum=2 with micro-batch b leaves the same weights as one micro-batch of 2b sequences."""
    common = [*TINY, "sched=constant", "optim.weight_decay=0.0"]
    big, _ = build_from(*common, "accum=1", "data.batch_size=8")
    small, _ = build_from(*common, "accum=2", "data.batch_size=4")
    before = flat_params(big.model)
    data = big.data.train
    for s in range(3):
        x, y = data.x[8 * s : 8 * s + 8], data.y[8 * s : 8 * s + 8]
        step(big, [(x, y)])
        step(small, [(x[:4], y[:4]), (x[4:], y[4:])])
    assert (flat_params(big.model) - before).abs().max() > 1e-4
    torch.testing.assert_close(flat_params(small.model), flat_params(big.model), rtol=0, atol=1e-6)


def gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    args = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, **kwargs}
    return create_gpt((8,), 32, **args)


def test_attention_is_causal_and_the_head_is_the_embedding():
    model = gpt()
    tokens = torch.randint(0, 32, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % 32
    a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :5], b[0, :5]) and not torch.equal(a[0, 5:], b[0, 5:])  # no position sees the future
    assert model.lm_head.weight is model.wte.weight


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    tokens = torch.randint(0, 32, (2, 8))
    change = {}
    for qk_norm in (False, True):
        model = gpt(qk_norm=qk_norm)
        before = model(tokens)
        with torch.no_grad():
            for block in model.blocks:
                block.attn.qkv.weight[: 2 * 16] *= 30.0  # the query and key rows
        change[qk_norm] = (model(tokens) - before).abs().max().item()
    assert change[True] < 1e-4 < 1e-2 < change[False]  # (what remains: the norm's epsilon)


@pytest.mark.parametrize("proj_init,std", [("gpt2", 0.02 / math.sqrt(2 * 2)), ("zero", 0.0), ("plain", 0.02)])
def test_residual_projections_start_scaled_zero_or_plain(proj_init, std):
    model = gpt(n_embd=64, proj_init=proj_init, mlp="swiglu", norm="rmsnorm")
    weights = torch.cat([layer.weight.flatten() for layer in model.residual_projections()])
    assert weights.std().item() == pytest.approx(std, rel=0.05, abs=1e-9)
    assert model.blocks[0].mlp.fc.out_features % 16 == 0  # SwiGLU's hidden width: float8-friendly


def test_the_pydoc_corpus_is_bytes_split_by_topic():
    data = load_pydoc(block_size=64)
    assert data.num_classes == 256 and data.input_shape == (64,) and data.bytes_per_token == 1.0
    for split in (data.train, data.val):
        assert torch.equal(split.y[:, :-1], split.x[:, 1:])  # the targets are the next bytes
    share = len(data.val) / (len(data.train) + len(data.val))
    assert 0.05 < share <= 0.1
    assert load_pydoc(block_size=64, seed=1).val.x.shape != data.val.x.shape or not torch.equal(
        load_pydoc(block_size=64, seed=1).val.x, data.val.x
    )  # another seed holds out other topics


def test_text_files_are_read_and_a_missing_folder_is_one_error(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 200)
    (tmp_path / "skip.md").write_text("not matched")
    data = load_text(str(tmp_path), block_size=32)
    text = bytes(torch.cat([data.train.x.flatten(), data.val.x.flatten()]).tolist())
    assert b"not matched" not in text and b"document 3" in text
    with pytest.raises(ConfigError, match=r"data\.root=.*no such directory"):
        load_text(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"no file matching \*\.rst"):
        load_text(str(tmp_path), pattern="*.rst")


def test_token_files_are_memory_mapped_and_malformed_ones_are_one_error(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "train.bin")
    tokens[:200].tofile(tmp_path / "val.bin")
    data = load_tokens(str(tmp_path), block_size=10, vocab_size=300, num_workers=0)
    x, y = data.train[3]
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41)) and len(data.train) == 99
    with pytest.raises(ConfigError, match=r"data\.vocab_size=100: .*train\.bin holds token id 100 at position 100 "):
        load_tokens(str(tmp_path), block_size=10, vocab_size=100)
    with pytest.raises(ConfigError, match=r"val\.bin holds 200 tokens, a block needs 201.*block_size<=199$"):
        load_tokens(str(tmp_path), block_size=200, vocab_size=300)
    (tmp_path / "val.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match=r"val\.bin is 3 bytes, not a multiple of 2: not a uint16 token file"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=300)
    (tmp_path / "val.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"val\.bin is empty \(0 bytes\)"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=300)
    with pytest.raises(ConfigError, match=r"no train\.bin here"):
        load_tokens(str(tmp_path / "nothing"))


def test_uint32_token_files_are_read_as_such_and_one_read_as_uint16_is_an_error(tmp_path):
    """A vocabulary past 65,536 ids needs uint32 files (data.dtype=uint32); such a file read as uint16
    shows a 0 at every odd position (the ids' high halves, little-endian): said, not trained on."""
    ids = (np.arange(1000, dtype=np.uint32) * 7919) % 300
    ids.tofile(tmp_path / "train.bin")
    ids[:200].tofile(tmp_path / "val.bin")
    data = load_tokens(str(tmp_path), block_size=10, vocab_size=300, dtype="uint32", num_workers=0)
    x, _ = data.train[2]
    assert torch.equal(x, torch.from_numpy(ids[20:30].astype(np.int64))) and len(data.train) == 99
    with pytest.raises(
        ConfigError, match=r"data\.dtype=uint16: .*train\.bin: every second 16-bit value is 0, .*uint32"
    ):
        load_tokens(str(tmp_path), block_size=10, vocab_size=300)
    with pytest.raises(ConfigError, match=r"data\.dtype=uint16: holds ids up to 65535 and data\.vocab_size=128256"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=128256)
    ids[5] = 100_000  # a large vocabulary's id: checked against it as any other
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"token id 100000 at position 5 .*at least 100001 .*for 70000 ids$"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=70_000, dtype="uint32")
    # uint16 files read as uint32: two ids make one far past the vocabulary, and the error says why
    (np.arange(1000, dtype=np.uint16) % 300).tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"if the files hold uint16 ids, data\.dtype=uint16$"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=300, dtype="uint32")


def one_line_error(result) -> str:
    """What a user sees of a config error: exit code 2 and one line, no traceback."""
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    return line


def test_a_token_id_out_of_range_anywhere_is_one_line_naming_the_file_the_id_and_its_position(cli, tmp_path):
    tokens = np.arange((1 << 20) + 1000, dtype=np.uint16) % 256  # past the first million tokens
    tokens[-10] = 60000
    tokens.tofile(tmp_path / "train.bin")
    tokens[:500].tofile(tmp_path / "val.bin")
    result = cli.run(*TINY, "data=tokens", f"data.root={tmp_path}", "data.vocab_size=256", "data.num_workers=0")
    line = one_line_error(result)
    at = len(tokens) - 10
    train = tmp_path / "train.bin"
    assert line.startswith(f"error: data.vocab_size=256: {train} holds token id 60000 at position {at} ")
    assert "set data.vocab_size to at least 60001" in line


def test_the_token_id_check_reads_the_whole_file_in_chunks_and_reports_the_first_bad_id(tmp_path, monkeypatch):
    import halfprec.components.data.text as text

    monkeypatch.setattr(text, "CHUNK", 1000)  # the file spans many chunks
    tokens = np.zeros(10_000, dtype=np.uint16)
    tokens[[5500, 9999]] = [300, 400]
    tokens.tofile(tmp_path / "train.bin")
    np.zeros(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    match = r"train\.bin holds token id 300 at position 5500 .*set data\.vocab_size to at least 401"
    with pytest.raises(ConfigError, match=match):
        load_tokens(str(tmp_path), block_size=10, vocab_size=256)
    tokens[:] = 0
    tokens.tofile(tmp_path / "val.bin")
    tokens[9999] = 256
    tokens.tofile(tmp_path / "train.bin")  # the very last id, one past the vocabulary
    with pytest.raises(ConfigError, match=r"token id 256 at position 9999 .*at least 257"):
        load_tokens(str(tmp_path), block_size=10, vocab_size=256)
    assert len(load_tokens(str(tmp_path), block_size=10, vocab_size=257, num_workers=0).train) == 999


def test_an_empty_text_corpus_is_said_to_be_empty(cli, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    line = one_line_error(cli.run(*TINY, "data=text", f"data.root={tmp_path}"))
    assert line == f"error: data.root={tmp_path}: {tmp_path / 'a.txt'} is empty: put some text there"
    (tmp_path / "b.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"the 2 files matching \*\.txt in data\.root are all empty: put some text"):
        load_text(str(tmp_path), block_size=16)
    # an empty file among others holds no document: it is not the validation split
    for name in ("c.txt", "d.txt"):
        (tmp_path / name).write_text(f"{name} " * 500)
    data = load_text(str(tmp_path), block_size=16)
    assert len(data.train) > 0 and len(data.val) > 0


def test_a_short_text_is_reported_at_its_size_on_disk_with_a_block_size_that_works(cli, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 27)
    line = one_line_error(cli.run(*TINY, "data=text", f"data.root={tmp_path}", "model.block_size=128"))
    assert line.startswith(f"error: data.block_size=128: longer than the text: {tmp_path / 'a.txt'} is 27 bytes, ")
    assert "73" not in line and "use model.block_size<=3" in line
    assert len(load_text(str(tmp_path), block_size=3).val) == 1  # what the message offers works
    (tmp_path / "b.txt").write_bytes(b"y" * 30)
    both = r"the 2 files matching \*\.txt in data\.root are 57 bytes in all, the training split holds 30 of them"
    with pytest.raises(ConfigError, match=both):
        load_text(str(tmp_path), block_size=64)


def test_validation_shares_of_token_blocks_pad_whole_sequences():
    data = load_pydoc(block_size=16)
    val = type(data.val)(data.val.x[:5], data.val.y[:5])
    (_, y_rank1), *_ = eval_batches(val, 8, torch.device("cpu"), rank=1, world_size=2)
    assert y_rank1.shape == (3, 16) and (y_rank1[-1] == IGNORE_LABEL).all() and (y_rank1[0] != IGNORE_LABEL).all()


def test_task_lm_trains_from_the_command_line_and_logs_its_metrics(cli):
    result = cli.run(*TINY, "trainer.max_steps=3", "trainer.val_every=3", "logger=none", cheap=False)
    result.check()
    rows = result.metrics()
    assert {"perf/tokens_per_s", "train/loss"} <= rows[0].keys()
    assert rows[0]["perf/tokens_per_s"] == pytest.approx(rows[0]["perf/samples_per_s"] * 16)
    last = rows[-1]
    assert {"val/loss", "val/ppl", "val/bpb"} <= last.keys() and "val/acc" not in last
    assert last["val/bpb"] == pytest.approx(last["val/loss"] / math.log(2))
    assert last["val/loss"] < math.log(256)  # three steps already beat a uniform guess


def test_task_lms_optimizer_values_reach_adamw_and_its_variants_alone(cli):
    """task=lm's lr, betas, weight decay and clipping are AdamW's (conf/task_optim/lm_adamw.yaml):
    every AdamW variant takes them, SGD keeps its own and trains, the command line wins over both,
    and the run says what it trains with."""
    lm = {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.1, "clip_grad_norm": 1.0}
    for optim in ("adamw", "adamw_bf16", "adamw8bit", "adamw4bit", "adamw_fp8"):
        cfg = compose_cfg("task=lm", f"optim={optim}")
        assert {k: cfg.optim[k] for k in lm} == lm, optim
    sgd = compose_cfg("task=lm", "optim=sgd").optim
    assert (sgd.lr, sgd.momentum, sgd.weight_decay, sgd.clip_grad_norm, "betas" in sgd) == (0.1, 0.9, 0.0, None, False)
    assert compose_cfg("task=lm", "optim.lr=1e-3").optim.lr == 1e-3
    assert compose_cfg("optim=adamw").optim.lr == 0.001  # classification: AdamW's own values
    result = cli.run(*TINY, "optim=sgd", "trainer.max_steps=2", "logger=none")
    result.check()
    assert "optim: SGD lr=0.1 momentum=0.9 nesterov=false weight_decay=0.0" in result.stderr.splitlines()


def test_a_resumed_lm_run_logs_what_an_uninterrupted_one_does(tmp_path):
    overrides = [*TINY, "trainer.ckpt_every=3", "trainer.val_every=3"]
    run(compose_cfg(*overrides, "trainer.max_steps=6"), tmp_path / "straight")
    run(compose_cfg(*overrides, "trainer.max_steps=3"), tmp_path / "resumed")
    run(compose_cfg(*overrides, "trainer.max_steps=6", "resume=auto"), tmp_path / "resumed")
    straight, resumed = (read_jsonl(tmp_path / run_dir / "metrics.jsonl") for run_dir in ("straight", "resumed"))
    assert without_perf(resumed) == without_perf(straight)


def test_a_classification_setup_with_text_data_is_one_error():
    from halfprec.config import validate

    with pytest.raises(ConfigError) as info:
        validate(compose_cfg("data=pydoc"))
    assert str(info.value) == (
        "data=pydoc: gives token sequences and task=classification learns from class labels: "
        "use data=digits, synthetic, cifar10 or imagefolder, or task=lm"
    )


def test_validation_forwards_a_micro_batch_at_a_time():
    """The logits are (batch, block, vocabulary): validating 256 blocks at once took a run with
    GPT-2's 50257 ids from 2.4 to 8.4 GiB of peak memory. Classification keeps batches of 256."""
    from halfprec.training.metrics import evaluate

    for overrides, most in ((TINY, 4), (["model.hidden=[16]"], 256)):
        c, cfg = build_from(*overrides, "data.batch_size=4")
        seen: list[int] = []
        c.model.register_forward_hook(lambda module, args, out, seen=seen: seen.append(len(args[0])))
        evaluate(c.model, c.data, c.stepper.task, c.stepper.policy, cfg.data.batch_size, c.device)
        assert max(seen) == most and sum(seen) == len(c.data.val), seen


def test_diagnostics_keep_the_largest_causal_attention_logit_and_the_output_log_z():
    from halfprec.components.models.gpt import CausalSelfAttention, Layout
    from halfprec.training.diagnostics import Diagnostics

    attn = CausalSelfAttention(4, 1, 0.0, False, Layout("layernorm", None, "gelu", False))
    q = torch.tensor([[[[1.0, 0, 0, 0], [0, 2.0, 0, 0]]]])  # (batch, heads, time 2, head dim 4)
    k = torch.tensor([[[[0, 3.0, 0, 0], [0, 5.0, 0, 0]]]])
    attn.keep_logit_max(q, k)
    # q1.k1 = 0, q2.k1 = 6, q2.k2 = 10; q1.k2 = 0 is masked out (the future); divided by sqrt(4)
    assert attn.logit_max.item() == pytest.approx(5.0)

    model = gpt()
    diag = Diagnostics(compose_cfg("diagnostics=grads").diagnostics, model, build_from(*TINY)[0].stepper.params)
    tokens = torch.randint(0, 32, (2, 8))
    with diag.watch_logits():
        out = model(tokens)
    row = diag.collect()
    assert set(diag.attention) == {"blocks.0.attn", "blocks.1.attn"}
    assert row["diag/attn_logit_max"] == max(row["attn_logit_max/blocks.0.attn"], row["attn_logit_max/blocks.1.attn"])
    log_z = torch.logsumexp(out.detach(), dim=-1)
    assert row["diag/output_logz"] == pytest.approx(log_z.mean().item(), rel=1e-6)
    assert row["diag/output_logz_max"] == pytest.approx(log_z.max().item(), rel=1e-6)
    assert not any(layer.record_logits for layer in (model.blocks[0].attn, model.blocks[1].attn))  # off again


def test_a_diagnosed_lm_run_logs_and_plots_the_logit_growth(tmp_path):
    from halfprec.tools.report import write_report

    run(compose_cfg(*TINY, "diagnostics=grads", "diagnostics.every=2"), tmp_path / "run")
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "diag/attn_logit_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 4] and all(r["diag/output_logz"] > 0 for r in rows)
    write_report(tmp_path / "run", tmp_path / "report")
    assert (tmp_path / "report" / "attn_logits.png").is_file() and (tmp_path / "report" / "logz.png").is_file()
    # the table shows what a language model logs, not a classifier's val/acc
    header, *_, last = [line.split("|")[1:-1] for line in (tmp_path / "report" / "report.md").read_text().splitlines()
                        if line.startswith("|")]  # fmt: skip
    cells = dict(zip([h.strip() for h in header], [c.strip() for c in last]))
    assert "val/acc" not in cells and {"val/bpb", "tokens/s", "peak attn logit"} <= set(cells)
    assert float(cells["peak attn logit"]) == pytest.approx(max(r["diag/attn_logit_max"] for r in rows), rel=1e-3)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert float(cells["val/bpb"]) == pytest.approx(summary["val/bpb"], abs=1e-4)
