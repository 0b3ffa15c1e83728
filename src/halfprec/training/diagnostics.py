"""Gradient diagnostics (the `diagnostics` group): per layer, how many gradient values fp16 could
not hold, a histogram of their exponents, which layer a skipped step's inf/NaN came from, the
quantization statistics of the quantized layers and their gradient-to-noise ratio, those that the
formats of diagnostics.shadow would have on every Linear layer (what-if statistics, leaving the
run's values as they are), and with low-precision weights without masters, how much of the update
rounding to nearest loses.

Everything is computed on the device and read back in one transfer per diagnostics step; with
`diagnostics=none` the optimizer step runs exactly as without this module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from halfprec.loggers import Histogram
from halfprec.numerics.attention import ATTENTION_OPERANDS, QuantizedAttention, ScaledDotProduct, causal_softmax
from halfprec.numerics.grads import full
from halfprec.numerics.params import LowPrecisionParams, ParamStrategy
from halfprec.numerics.policy import COMPUTE_TYPES
from halfprec.numerics.quantized import OPERANDS, QuantizedLinear, what_if_sums

FP16_TINY = 2.0**-24  # smallest fp16 subnormal: a smaller magnitude becomes 0 in fp16
FP16_MAX = 65504.0  # largest finite fp16: a larger magnitude becomes inf
# the operands with statistics, in the order of a layer's keys: a Linear layer's, then an attention core's
STAT_OPERANDS = tuple(dict.fromkeys([*OPERANDS, *ATTENTION_OPERANDS]))
LOG2_RANGE = (-40, 20)  # histogram of log2|g|, one bin per power of two; values outside land in the end bins


def layer_of(param_name: str) -> str:
    """The module a parameter belongs to: `blocks.3.conv1.weight` -> `blocks.3.conv1`."""
    return param_name.rpartition(".")[0] or param_name


def _counts(values: torch.Tensor, tiny: float) -> torch.Tensor:
    """[values, exactly zero, 0 < |v| < tiny, |v| > FP16_MAX or non-finite] of a flat tensor, on its device."""
    a = values.detach().float().abs()
    zero = (a == 0).sum()
    under = ((a > 0) & (a < tiny)).sum()
    over = (~(a <= FP16_MAX)).sum()  # inf and NaN count as overflow
    return torch.stack([torch.tensor(a.numel(), device=a.device), zero, under, over]).float()


def _log2_histogram(values: torch.Tensor) -> torch.Tensor:
    low, high = LOG2_RANGE
    a = values.detach().float().abs()
    a = a[(a > 0) & torch.isfinite(a)]
    return torch.histc(a.log2().clamp(low, high - 1e-3), bins=high - low, min=low, max=high)


@runtime_checkable
class RecordsLogits(Protocol):
    """An attention layer that keeps its largest logit of a step while `record_logits` is on."""

    record_logits: bool
    logit_max: torch.Tensor | None


@runtime_checkable
class KeepsStats(Protocol):
    """A quantized layer or attention core that sums its operands' statistics while `stats` is a dict."""

    stats: dict[str, torch.Tensor] | None


class Diagnostics:
    def __init__(self, cfg, model: nn.Module, params: ParamStrategy):
        self.every = int(cfg.every)
        self.activations = bool(cfg.activations)
        self.skips = bool(cfg.skips)
        self.model = model
        self.compute_layers = [name for name, m in model.named_modules() if isinstance(m, COMPUTE_TYPES)]
        # parameter indices (in ParamStrategy order) per layer, layers in model order
        self.layers: dict[str, list[int]] = {}
        for i, name in enumerate(params.names):
            self.layers.setdefault(layer_of(name), []).append(i)
        self._grad_counts: torch.Tensor | None = None
        self._grad_hists: torch.Tensor | None = None
        self._act_counts: dict[str, torch.Tensor] = {}
        # attention layers that can record their logits' maximum (a GPT's)
        self.attention = [name for name, m in model.named_modules() if isinstance(m, RecordsLogits)]
        self._log_z: list[torch.Tensor] = []  # per micro-batch: [mean, max] of the output's log Z
        # the quantized Linear layers and attention cores, which keep statistics while their `stats` is a dict
        self.quantized = [n for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedAttention))]
        self._quant: dict[str, dict[str, torch.Tensor]] = {}
        # bf16/fp16 weights that the update is rounded into (no fp32 masters): update_lost/<layer>
        self.rounded = params if isinstance(params, LowPrecisionParams) else None
        self._lost: dict[int, torch.Tensor] = {}
        # what-if formats (numerics/formats' FORMATS), each on every Linear layer, quantized or not
        self.shadow = list(dict.fromkeys(cfg.shadow))
        self.linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        # with diagnostics.shadow_attention, the attention cores too (torch's fused attention or quantized)
        self.cores = [n for n, m in model.named_modules() if isinstance(m, ScaledDotProduct) and cfg.shadow_attention]
        self.shadowed = [n for n in dict(model.named_modules()) if n in self.linears or n in self.cores]
        self._shadow: dict[tuple[str, str, str], torch.Tensor] = {}  # (format, layer, operand): quant_sums

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def watchers(self, scale: float) -> list[contextlib.AbstractContextManager]:
        """The hooks a diagnostics step runs under, in the order they are entered."""
        watchers: list[contextlib.AbstractContextManager] = []
        if self.activations:
            watchers.append(self.watch_activation_gradients(scale))
        watchers.append(self.watch_logits())
        if self.quantized:
            watchers.append(self.watch_quantization())
        watchers.append(self.watch_updates())  # bf16/fp16 weights without masters
        if self.shadow:
            watchers.append(self.watch_shadow())
        return watchers

    @torch.no_grad()
    def inspect_gradients(self, params: ParamStrategy) -> None:
        """Called by the optimizer step between unscaling and clipping: the true gradients.
        Under FSDP every rank calls it (each sharded gradient is gathered)."""
        grads = [p.grad for p in params.params]
        counts, hists = [], []
        for indices in self.layers.values():
            flat = [full(grad).flatten() for grad in (grads[i] for i in indices) if grad is not None]
            if not flat:
                counts.append(torch.zeros(4, device=params.params[indices[0]].device))
                hists.append(torch.zeros(LOG2_RANGE[1] - LOG2_RANGE[0], device=counts[-1].device))
                continue
            values = torch.cat(flat)
            counts.append(_counts(values, FP16_TINY))
            hists.append(_log2_histogram(values))
        self._grad_counts, self._grad_hists = torch.stack(counts), torch.stack(hists)

    @contextlib.contextmanager
    def watch_activation_gradients(self, scale: float) -> Iterator[None]:
        """Count the gradients flowing into each Linear/Conv output during this step's backward,
        unscaled (a value below FP16_TINY * scale is below FP16_TINY once the scale is divided out)."""
        self._act_counts = {}

        def forward_hook(name: str):
            def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
                if torch.is_tensor(out) and out.requires_grad:
                    out.register_hook(lambda g: self._add_act(name, _counts(g.flatten(), FP16_TINY * scale)))

            return hook

        handles = [
            self.model.get_submodule(name).register_forward_hook(forward_hook(name)) for name in self.compute_layers
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def watch_logits(self) -> Iterator[None]:
        """The two instabilities of large-lr transformer training: attention logits that grow
        (Dehghani et al. 2023; qk-norm bounds them) and output logits whose log-normaliser log Z
        drifts (Chowdhery et al. 2022; z-loss holds it near 0). The attention layers record their
        logits' maximum for this step; a hook reads log Z off the model's output."""
        layers = [cast(RecordsLogits, self.model.get_submodule(name)) for name in self.attention]
        for layer in layers:
            layer.record_logits, layer.logit_max = True, None
        self._log_z = []

        def log_z(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if torch.is_tensor(out) and out.is_floating_point() and out.dim() >= 2:
                z = torch.logsumexp(out.detach().float(), dim=-1)
                self._log_z.append(torch.stack([z.mean(), z.max()]))

        handle = self.model.register_forward_hook(log_z)
        try:
            yield
        finally:
            handle.remove()
            for layer in layers:
                layer.record_logits = False

    def _logit_row(self) -> dict:
        row: dict = {}
        maxima = [cast(RecordsLogits, self.model.get_submodule(n)).logit_max for n in self.attention]
        found = [(n, m) for n, m in zip(self.attention, maxima) if m is not None]
        if found:
            values = torch.stack([m for _, m in found]).cpu().tolist()
            row.update({f"attn_logit_max/{n}": v for (n, _), v in zip(found, values)})
            row["diag/attn_logit_max"] = max(values)
        if self._log_z:
            z = torch.stack(self._log_z).cpu()
            row["diag/output_logz"], row["diag/output_logz_max"] = float(z[:, 0].mean()), float(z[:, 1].max())
        self._log_z = []
        return row

    @contextlib.contextmanager
    def watch_quantization(self) -> Iterator[None]:
        """Where the bits go: each quantized layer sums, over this step's micro-batches, the error
        and the values lost to underflow and saturation of its operands (QuantizedLinear.record; an
        attention core's, QuantizedAttention.record)."""
        layers = [cast(KeepsStats, self.model.get_submodule(name)) for name in self.quantized]
        for layer in layers:
            layer.stats = {}
        try:
            yield
        finally:
            self._quant = {name: layer.stats or {} for name, layer in zip(self.quantized, layers)}
            for layer in layers:
                layer.stats = None

    @contextlib.contextmanager
    def watch_shadow(self) -> Iterator[None]:
        """What each format of diagnostics.shadow would do to every Linear layer this step, whatever the
        run computes in: each operand blocked along the dimension the forward GEMM (input, weight: along
        `in`) or the input-gradient GEMM (grad_output: along `out`) contracts, its quant_sums added up
        over the micro-batches on the device. Read-only hooks, removed afterwards: the run's values,
        random streams included, are those of a run without them (tests/test_shadow.py)."""
        self._shadow = {}

        def forward_hook(name: str):
            def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
                if args and torch.is_tensor(args[0]):
                    self._add_shadow(name, "input", args[0].reshape(-1, args[0].shape[-1]))
                self._add_shadow(name, "weight", cast(nn.Linear, module).weight)
                if torch.is_tensor(out) and out.requires_grad:  # the gradient as the backward gets it
                    out.register_hook(lambda g: self._add_shadow(name, "grad_output", g.reshape(-1, g.shape[-1])))

            return hook

        handles = [self.model.get_submodule(name).register_forward_hook(forward_hook(name)) for name in self.linears]
        handles += [self.model.get_submodule(name).register_forward_hook(self._core_hook(name)) for name in self.cores]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _core_hook(self, name: str):
        """watch_shadow's hook on an attention core (diagnostics.shadow_attention): its operands blocked
        as the quantized core blocks them where first quantized (QuantizedAttention), Q and K along d,
        V and P along the keys, dO along the queries (dV = P^T dO), dS along the keys (dQ = dS K). P and
        dS are recomputed in fp32 from the core's Q, K, V, output and dO (torch's fused attention does
        not show them): those of attention in high precision, before dropout."""

        @torch.no_grad()
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            with torch.autocast(out.device.type, enabled=False):
                q, k, v = (t.detach().float().flatten(0, -3) for t in args[:3])  # batch x heads, tokens, d
                scale = 1 / math.sqrt(q.shape[-1])
                p = causal_softmax(q @ k.transpose(-2, -1), scale)
                for operand, t in (("query", q), ("key", k), ("value", v.transpose(-2, -1)), ("probs", p)):
                    self._add_shadow(name, operand, t)
            if out.requires_grad:
                o = out.detach().float().flatten(0, -3)
                out.register_hook(lambda g: self._add_core_grads(name, g, v, p, o, scale))

        return hook

    @torch.no_grad()
    def _add_core_grads(self, name: str, grad: torch.Tensor, v: torch.Tensor, p: torch.Tensor, o: torch.Tensor,
                        scale: float) -> None:  # fmt: skip
        """An attention core's dO and dS = s P (dO V^T - rowsum(dO O)) (returns None: the gradient is left as is)."""
        with torch.autocast(grad.device.type, enabled=False):
            do = grad.detach().float().flatten(0, -3)
            ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True)) * scale
            self._add_shadow(name, "grad_output", do.transpose(-2, -1))
            self._add_shadow(name, "grad_scores", ds)

    @torch.no_grad()
    def _add_shadow(self, layer: str, operand: str, t: torch.Tensor) -> None:
        """Add each shadow format's sums of `t` (returns None: a tensor hook leaves the gradient as it is)."""
        with torch.autocast(t.device.type, enabled=False):  # the statistics in fp32, as QuantizedLinear's
            for fmt in self.shadow:
                key = (fmt, layer, operand)
                self._shadow[key] = what_if_sums(t, fmt) + self._shadow.get(key, 0)

    def _quant_row(self) -> dict:
        """quant/<layer>/<operand>/{rel_err, underflow, saturated} and the model's mean and largest
        rel_err, from the sums of watch_quantization; the same per shadow format (shadow/<format>/...,
        diag/shadow/<format>/rel_err and rel_err_max) from those of watch_shadow, and the gradient-to-noise
        ratios (grad_noise_row); read back in one transfer."""
        quant, self._quant = self._quant, {}
        shadow, self._shadow = self._shadow, {}
        # (key prefix, layer, operand, sums): quantized layers in model order, then each shadow format's
        cells = [
            ("quant", layer, op, stats[op]) for layer, stats in quant.items() for op in STAT_OPERANDS if op in stats
        ]
        cells += [
            (f"shadow/{fmt}", layer, op, shadow[fmt, layer, op])
            for fmt in self.shadow
            for layer in self.shadowed
            for op in STAT_OPERANDS
            if (fmt, layer, op) in shadow
        ]
        if not cells:
            return {}
        noisy = [layer for layer, stats in quant.items() if "wgrad_noise" in stats]
        norms = [torch.stack([quant[n]["wgrad_exact"].square().sum(), quant[n]["wgrad_noise"].square().sum()])
                 for n in noisy]  # fmt: skip
        flat = torch.cat([torch.stack([cell[3] for cell in cells]).flatten(), *norms]).cpu().tolist()
        sums = [flat[i : i + 6] for i in range(0, 6 * len(cells), 6)]  # the one host read, split
        row = grad_noise_row(noisy, flat[6 * len(cells) :])
        errors: dict[str, list[float]] = {}  # per prefix
        for (prefix, layer, op, _), (sq_err, sq_norm, count, nonzero, under, sat) in zip(cells, sums):
            key = f"{prefix}/{layer}/{op}"
            row[f"{key}/rel_err"] = math.sqrt(sq_err / sq_norm) if sq_norm > 0 else 0.0
            row[f"{key}/underflow"] = under / nonzero if nonzero else 0.0
            row[f"{key}/saturated"] = sat / count if count else 0.0
            errors.setdefault(prefix, []).append(row[f"{key}/rel_err"])
        for prefix, values in errors.items():  # diag/quant_rel_err, diag/shadow/mxfp4/rel_err
            mean = f"diag/{prefix}_rel_err" if prefix == "quant" else f"diag/{prefix}/rel_err"
            row[mean], row[f"{mean}_max"] = sum(values) / len(values), max(values)
        return row

    @contextlib.contextmanager
    def watch_updates(self) -> Iterator[None]:
        """How much of this step's update rounding to nearest loses in the weights' own dtype: the
        parameter strategy counts it, per parameter, between the optimizer's fp32 step and the
        rounding (LowPrecisionParams.finish_). A skipped step counts nothing. Other strategies have
        fp32 weights or fp32 masters, which lose nothing of this kind: nothing to watch."""
        params = self.rounded
        if params is None:
            yield
            return
        params.lost = {}
        try:
            yield
        finally:
            self._lost, params.lost = params.lost, None

    def _lost_by_layer(self) -> tuple[list[str], torch.Tensor | None]:
        """The layers with counted parameters (model order) and their [moved, lost] sums, (layers, 2)
        on the device. A layer kept in fp32 (a norm under keep_norm_fp32) has none: it has no key."""
        lost, self._lost = self._lost, {}
        found = [(layer, [lost[i] for i in indices if i in lost]) for layer, indices in self.layers.items()]
        found = [(layer, counts) for layer, counts in found if counts]
        if not found:
            return [], None
        return [layer for layer, _ in found], torch.stack([torch.stack(counts).sum(0) for _, counts in found])

    def _add_act(self, name: str, counts: torch.Tensor) -> None:
        self._act_counts[name] = counts + self._act_counts.get(name, 0)

    def collect(self) -> dict:
        """The row for this diagnostics step: fractions for metrics.jsonl and W&B, histograms for W&B."""
        row: dict = {}
        lost_layers, lost = self._lost_by_layer()
        counts, hists, lost = _read([self._grad_counts, self._grad_hists, lost])  # the one host read
        if counts is not None and hists is not None:  # set together
            row.update(_fractions("grad", list(self.layers), counts))
            edges = [float(e) for e in range(LOG2_RANGE[0], LOG2_RANGE[1] + 1)]
            for layer, hist in zip(self.layers, hists):
                if hist.sum() > 0:
                    row[f"grad_log2/{layer}"] = Histogram([int(c) for c in hist.tolist()], edges)
        if lost is not None:
            row.update(_lost_shares(lost_layers, lost))
        if self._act_counts:
            names = [n for n in self.compute_layers if n in self._act_counts]  # model order
            row.update(_fractions("act", names, torch.stack([self._act_counts[n] for n in names]).cpu()))
        row.update(self._logit_row())
        row.update(self._quant_row())
        self._grad_counts = self._grad_hists = None
        self._act_counts = {}
        return row

    def skip_source(self, loss: torch.Tensor, culprit: str | None) -> str:
        """Where a skipped step's inf/NaN came from, in words (read only on skipped steps)."""
        if not bool(torch.isfinite(loss)):
            return "the forward pass (the loss itself is inf/NaN: an activation overflowed)"
        if culprit is None:
            return "no parameter gradient is inf/NaN on this rank (another rank overflowed)"
        layer = layer_of(culprit)
        kind = type(self.model.get_submodule(layer)).__name__ if layer != culprit else "parameter"
        return f"{layer} ({kind})"


def grad_noise_row(layers: list[str], squares: list[float]) -> dict:
    """The gradient-to-noise ratio of "FP4 All the Way" (Chmiel et al. 2025, section 4), ||dW|| /
    ||noise||, from each layer's squared norms [exact dW, its quantization noise] in pairs: per
    layer (grad_noise/<layer>) and over the model's quantized weight gradients (diag/grad_noise).
    The paper's is ||grad L|| / (sigma_q sqrt(d)); sigma_q sqrt(d) is the noise's expected norm, of
    which this step's noise norm is a one-sample estimate. Quantized training stops helping below about
    sqrt(3) (precision.schedule's grad_noise_below_sqrt3 trigger)."""
    row: dict = {}
    grads, noises = squares[0::2], squares[1::2]
    for layer, grad, noise in zip(layers, grads, noises):
        if noise > 0:  # none: nothing this step rounded (a zero gradient)
            row[f"grad_noise/{layer}"] = math.sqrt(grad / noise)
    if layers and sum(noises) > 0:
        row["diag/grad_noise"] = math.sqrt(sum(grads) / sum(noises))
    return row


def _read(parts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors to the host in one transfer (one sync, not one per tensor), each back in its
    own shape and dtype: they travel as float64, which holds fp32 values and int64 counts below
    2^53 exactly. None stays None."""
    present = [t for t in parts if t is not None]
    if not present:
        return list(parts)
    flat = torch.cat([t.detach().flatten().double() for t in present]).cpu()
    chunks = iter(flat.split([t.numel() for t in present]))
    return [None if t is None else next(chunks).view(t.shape).to(t.dtype) for t in parts]


def _lost_shares(layers: list[str], counts: torch.Tensor) -> dict:
    """update_lost/<layer> and diag/update_lost from rows of [moved, lost]: the share of the weight
    values the optimizer moved this step (a non-zero fp32 update) that rounding to nearest leaves
    where they were; 0.0 where nothing moved. Values the update does not move are left out of the
    denominator, so that an unused embedding row or a zero gradient does not dilute the share."""
    rows = [(int(moved), int(lost)) for moved, lost in counts.tolist()]
    moved_total, lost_total = sum(m for m, _ in rows), sum(lost for _, lost in rows)
    row = {"diag/update_lost": lost_total / moved_total if moved_total else 0.0}
    for layer, (moved, lost) in zip(layers, rows):
        row[f"update_lost/{layer}"] = lost / moved if moved else 0.0
    return row


def _fractions(kind: str, layers: list[str], counts: torch.Tensor) -> dict:
    """Per-layer and whole-model fractions from rows of [n, zero, underflow, overflow]."""
    row: dict = {}
    total = counts.sum(0)
    n = max(float(total[0]), 1.0)
    row[f"diag/{kind}_underflow"] = float(total[2]) / n
    row[f"diag/{kind}_overflow"] = float(total[3]) / n
    row[f"diag/{kind}_zero"] = float(total[1]) / n
    for layer, c in zip(layers, counts):
        size = max(float(c[0]), 1.0)
        row[f"{kind}_underflow/{layer}"] = float(c[2]) / size
        row[f"{kind}_overflow/{layer}"] = float(c[3]) / size
        row[f"{kind}_zero/{layer}"] = float(c[1]) / size
    return row
