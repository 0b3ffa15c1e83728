"""Any timm model, built without downloading weights unless the config asks for them."""

from __future__ import annotations

import difflib
from typing import Annotated

from torch import nn

from halfprec.components.models import register_model
from halfprec.components.torchvision_import import import_torchvision
from halfprec.errors import ConfigError
from halfprec.spec import Spec


@register_model("timm", residual=False)
def create_timm_model(
    input_shape: tuple[int, ...],
    num_classes: int,
    name: Annotated[str, Spec(doc="a timm model name, e.g. resnet18")] = "resnet18",
    pretrained: Annotated[bool, Spec(doc="download timm's weights")] = False,
    kwargs=None,  # passed to timm.create_model as they are
) -> nn.Module:
    """`timm.create_model(name, in_chans=C, num_classes=...)`; `kwargs` are passed through. A model
    with a patch embedding (ViTs) is built for the data's image size unless kwargs name one."""
    import_torchvision("model", "timm")  # timm imports it: a mismatch with torch is one line, not timm's traceback
    import timm  # a slow import: only when a timm model is asked for

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError("model.name", name, f"no such timm model; {hint}timm.list_models('*part*') lists them")
    extra = dict(kwargs or {})
    model = timm.create_model(name, pretrained=pretrained, in_chans=input_shape[0], num_classes=num_classes, **extra)
    embed = getattr(model, "patch_embed", None)
    size = tuple(input_shape[1:])
    if embed is not None and "img_size" not in extra and tuple(getattr(embed, "img_size", size) or size) != size:
        # a ViT fixes its input size when built (224 from its name); the data says what it is
        model = timm.create_model(
            name, pretrained=pretrained, in_chans=input_shape[0], num_classes=num_classes, img_size=size, **extra
        )
    return model
