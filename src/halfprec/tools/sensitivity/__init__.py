"""`halfprec sensitivity RUN_DIR`: per layer and per number format, what computing a trained model's
Linear layer in the format does to its loss and gradients, and a `precision.rules` list that keeps
the most sensitive layers high (measure.py: the measurement; rules.py: the suggestion; output.py:
the files)."""

from __future__ import annotations

# The block-scaled formats that a precision option trains (conf/precision/: mxfp8, mxfp6, mxfp4,
# nvfp4, fp8_block): the default of --formats. Here, free of torch, for the command line's help.
BLOCK_FORMATS = ("mxfp8", "mxfp6_e2m3", "mxfp4", "nvfp4", "fp8_block")
