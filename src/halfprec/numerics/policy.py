"""Precision policy: the dtype the forward computes in, the dtype parameters are stored in,
which modules stay fp32, and how an optimizer update reaches low-precision parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from halfprec.errors import ConfigError, PrecisionMismatch
from halfprec.numerics.formats.casts import quiet_import

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Normalization statistics are sums of many squares: in fp16 they overflow or lose the mean.
# apex O2 and fairseq keep them in fp32; so do we (`precision.keep_norm_fp32`).
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
COMPUTE_TYPES = (nn.Linear, nn.modules.conv._ConvNd)


@dataclass
class PrecisionPolicy:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype
    master_weights: bool  # fp32 copies for the optimizer (pure modes only)
    update: str  # nearest | kahan | stochastic: how an update is rounded into low-precision weights
    keep_norm_fp32: bool
    tf32: bool
    device_type: str = "cpu"
    reduce_dtype: torch.dtype = torch.float32  # trainer=fsdp: dtype gradients are reduce-scattered in
    fp8: str | None = None  # torchao float8 recipe for Linear layers: tensorwise | rowwise
    fp8_emulate: bool = False
    fp8_layers: list[str] = field(default_factory=list)  # the Linear layers apply_fp8 converted

    @classmethod
    def from_config(cls, cfg, device_type: str) -> PrecisionPolicy:
        return cls(
            name=cfg.name,
            autocast_dtype=DTYPES[cfg.autocast] if cfg.autocast else None,
            param_dtype=DTYPES[cfg.param_dtype],
            master_weights=bool(cfg.master_weights),
            update=cfg["update"],  # not cfg.update: that is DictConfig.update()
            keep_norm_fp32=bool(cfg.keep_norm_fp32),
            tf32=bool(cfg.tf32),
            device_type=device_type,
            reduce_dtype=DTYPES[cfg.reduce_dtype],
            fp8=cfg.fp8,
            fp8_emulate=bool(cfg.fp8_emulate),
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    @property
    def is_pure(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def uses_fp16(self) -> bool:
        return torch.float16 in (self.autocast_dtype, self.param_dtype)

    def apply_backend_flags(self) -> None:
        """TF32 is process-wide in torch; set it explicitly so fp32 really means fp32."""
        if self.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_pure and x.is_floating_point():
            return x.to(self.param_dtype)
        return x

    def prepare_model(self, model: nn.Module) -> list[nn.Module]:
        """Cast the model to the parameter dtype; return the modules kept in fp32."""
        if not self.is_pure:
            return []
        model.to(self.param_dtype)
        kept: list[nn.Module] = []
        if self.keep_norm_fp32:
            for module in model.modules():
                if isinstance(module, NORM_TYPES):
                    module.float()
                    module.register_forward_pre_hook(_inputs_to_fp32)
                    module.register_forward_hook(_output_to(self.param_dtype))
                    kept.append(module)
        return kept

    def apply_fp8(self, model: nn.Module) -> list[str]:
        """precision=fp8: swap every Linear whose in and out features are multiples of 16 (what
        float8 matmuls need), but those the model names in `fp8_skip`, for torchao's Float8Linear;
        return their names. Before any wrapping
        (DDP, FSDP2, torch.compile), as torchao asks."""
        if not self.fp8:
            return []
        with quiet_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        # a model may keep layers in higher precision (`fp8_skip`: a GPT's output head, which is
        # tied to its embedding and is where the logits' range matters most)
        skipped = set(getattr(model, "fp8_skip", ()))

        def eligible(module: nn.Module, name: str) -> bool:
            fits = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            return fits and name not in skipped

        self.fp8_layers = [name for name, m in model.named_modules() if eligible(m, name)]
        if not self.fp8_layers:
            raise ConfigError(
                "precision", self.name, "no Linear layer of this model has in and out features divisible by 16, "
                "so none can compute in float8: widen the model or use precision=bf16",
            )  # fmt: skip
        config = replace(Float8LinearConfig.from_recipe_name(self.fp8), emulate=self.fp8_emulate)
        convert_to_float8_training(model, config=config, module_filter_fn=eligible)
        return self.fp8_layers

    def check(self, model: nn.Module, observed: set[torch.dtype], master: list[torch.Tensor]) -> dict:
        """Compare what the first step really did against the policy; raise on a mismatch."""
        expected = self.compute_dtype
        if observed != {expected}:
            got = ", ".join(sorted(_name(d) for d in observed)) or "nothing (no Linear/Conv layer ran)"
            raise PrecisionMismatch(
                f"precision={self.name}: Linear/Conv layers computed in {got}, expected {_name(expected)}; "
                "a module may disable autocast or cast its own inputs"
            )
        weights = {m.weight.dtype for m in model.modules() if isinstance(m, COMPUTE_TYPES)}
        if weights and weights != {self.param_dtype}:
            raise PrecisionMismatch(
                f"precision={self.name}: Linear/Conv weights are stored in "
                f"{', '.join(sorted(_name(d) for d in weights))}, expected {_name(self.param_dtype)}"
            )
        master_dtypes = {t.dtype for t in master}
        if self.master_weights and master_dtypes != {torch.float32}:
            raise PrecisionMismatch(f"precision={self.name}: master weights are not fp32")
        dtypes: dict[str, str | int] = {
            "precision/compute_dtype": _name(expected),
            "precision/param_dtype": _name(self.param_dtype),
            "precision/master_dtype": "float32" if self.master_weights or not self.is_pure else "none",
        }
        if self.fp8:  # the layers still Float8Linear at the first step: nothing swapped them back
            converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
            if sorted(converted) != sorted(self.fp8_layers):
                raise PrecisionMismatch(f"precision={self.name}: float8 layers {converted}, expected {self.fp8_layers}")
            dtypes["precision/fp8_layers"] = len(converted)
        return dtypes


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs_to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _output_to(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output):
        return output.to(dtype) if torch.is_tensor(output) else output

    return hook


@contextlib.contextmanager
def observe_compute_dtypes(model: nn.Module) -> Iterator[set[torch.dtype]]:
    """Collect the output dtypes of every Linear/Conv layer that runs inside the block."""
    seen: set[torch.dtype] = set()
    handles = [
        m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
        for m in model.modules()
        if isinstance(m, COMPUTE_TYPES)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
