"""`halfprec sensitivity RUN_DIR`: per layer and per number format, what computing a trained model's
Linear layer (with --attention, its attention core) in the format does to its loss and gradients,
and a `precision.rules` list that keeps the most sensitive layers high (measure.py: the measurement;
rules.py: the suggestion; output.py: the files)."""

from __future__ import annotations
