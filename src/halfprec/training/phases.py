"""precision.schedule's phase switches in a run (the phases themselves: numerics/schedule.py): before
a step, the phases due begin in the layers, each printed; after it, a switch is logged as
`precision/phase` with the layer counts, and a trigger that held on the diagnostics row fires."""

from __future__ import annotations

import sys

import torch

from halfprec.training.build import Components
from halfprec.training.distributed import any_rank


class PhaseSwitches:
    def __init__(self, c: Components):
        self.c, self.policy, self.schedule = c, c.stepper.policy, c.stepper.policy.schedule

    def begin(self, step: int) -> bool:
        """Begin the phases due by `step` in the layers, each printed; True when the formats at `step`
        differ from the step before's (on resume, checkpoint.restore has entered the phase it left)."""
        schedule = self.schedule
        if schedule is None or not schedule.advance(step):
            return False
        phase = schedule.phase_at(step)
        self.policy.enter_phase(self.c.model, phase)
        if self.c.world.is_main:
            for i in range(schedule.phase_at(step - 1), phase):
                print(f"step {step}: {schedule.describe(i)}", file=sys.stderr, flush=True)
        return True

    def row(self, step: int, switched: bool, row: dict) -> dict:
        """At step 1 and at a switch, the phase and the layer counts (the first-step check's, which also
        checks each layer computes as the phase says); on a diagnostics step, whether the trigger the
        next phase waits for holds in `row` (then that phase begins at the next step)."""
        c, schedule = self.c, self.schedule
        if schedule is None:
            return {}
        pending = schedule.pending_trigger()
        if pending is not None and pending[0] in row:  # every rank decides alike: the ranks' rows differ
            key, threshold = pending
            if any_rank(torch.tensor(float(row[key] < threshold), device=c.device)):
                schedule.fire(step)
        if not (switched or step == 1):
            return {}
        return {"precision/phase": schedule.phase_at(step), **self.policy.check_layers(c.model)}
