"""What a run is built from. The dataset modules register their loaders when imported, so the
registry (components/data.py, DATASETS) is whole whichever of them is imported first."""

from halfprec.components import data, text  # noqa: F401
