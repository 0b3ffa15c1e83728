"""The resolvers halfprec's config uses, registered before Hydra composes it (train.py):
`${halfprec.direction:...}` (conf/hparams_search/optuna.yaml) and `${halfprec.dirname:...}`
(conf/hydra/default.yaml's job dirs)."""

from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

from halfprec.launch.objective import direction

DIRNAME_MAX = 128  # a job dir's name after its number; file systems allow 255 bytes


def dirname(overrides: str) -> str:
    """A job dir's name from its overrides (Hydra's override_dirname): as it is when it is short,
    else its start and a hash of the whole, so that a sweep over long values (precision.rules
    lists) still gets a dir per job and distinct names; .hydra/overrides.yaml keeps them whole."""
    if len(overrides.encode()) <= DIRNAME_MAX:
        return overrides
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:8]
    return overrides.encode()[: DIRNAME_MAX - 9].decode(errors="ignore") + "~" + digest


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("halfprec.direction", direction, replace=True)
    OmegaConf.register_new_resolver("halfprec.dirname", dirname, replace=True)
