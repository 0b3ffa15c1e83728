"""Gradient diagnostics (the `diagnostics` group): per layer, how many gradient values fp16 could
not hold, a histogram of their exponents, which layer a skipped step's inf/NaN came from, the
quantization statistics of the quantized layers, and those that the formats of diagnostics.shadow
would have on every Linear layer (what-if statistics, leaving the run's values as they are).

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
from halfprec.numerics.grads import full
from halfprec.numerics.params import ParamStrategy
from halfprec.numerics.policy import COMPUTE_TYPES
from halfprec.numerics.quantized import OPERANDS, QuantizedLinear, what_if_sums

FP16_TINY = 2.0**-24  # smallest fp16 subnormal: a smaller magnitude becomes 0 in fp16
FP16_MAX = 65504.0  # largest finite fp16: a larger magnitude becomes inf
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
        self.quantized = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
        self._quant: dict[str, dict[str, torch.Tensor]] = {}
        # what-if formats (numerics/formats' FORMATS), each on every Linear layer, quantized or not
        self.shadow = list(dict.fromkeys(cfg.shadow))
        self.linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        self._shadow: dict[tuple[str, str, str], torch.Tensor] = {}  # (format, layer, operand): quant_sums

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

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
        and the values lost to underflow and saturation of its operands (QuantizedLinear.record)."""
        layers = [cast(QuantizedLinear, self.model.get_submodule(name)) for name in self.quantized]
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
        try:
            yield
        finally:
            for h in handles:
                h.remove()

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
        diag/shadow/<format>/rel_err and rel_err_max) from those of watch_shadow; read back in one transfer."""
        quant, self._quant = self._quant, {}
        shadow, self._shadow = self._shadow, {}
        # (key prefix, layer, operand, sums): quantized layers in model order, then each shadow format's
        cells = [("quant", layer, op, stats[op]) for layer, stats in quant.items() for op in OPERANDS if op in stats]
        cells += [
            (f"shadow/{fmt}", layer, op, shadow[fmt, layer, op])
            for fmt in self.shadow
            for layer in self.linears
            for op in OPERANDS
            if (fmt, layer, op) in shadow
        ]
        if not cells:
            return {}
        sums = torch.stack([cell[3] for cell in cells]).cpu().tolist()  # the one host read
        row: dict = {}
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

    def _add_act(self, name: str, counts: torch.Tensor) -> None:
        self._act_counts[name] = counts + self._act_counts.get(name, 0)

    def collect(self) -> dict:
        """The row for this diagnostics step: fractions for metrics.jsonl and W&B, histograms for W&B."""
        row: dict = {}
        if self._grad_counts is not None and self._grad_hists is not None:  # set together
            counts, hists = self._grad_counts.cpu(), self._grad_hists.cpu()  # the one host read
            row.update(_fractions("grad", list(self.layers), counts))
            edges = [float(e) for e in range(LOG2_RANGE[0], LOG2_RANGE[1] + 1)]
            for layer, hist in zip(self.layers, hists):
                if hist.sum() > 0:
                    row[f"grad_log2/{layer}"] = Histogram([int(c) for c in hist.tolist()], edges)
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
