"""The moving averages of variables (``tf.train.ExponentialMovingAverage``'s rule), one rule for every holder:
the ps keeps them for the variables it holds, hybrid mode's workers for the dense parameters they keep
(``worker/dense.py``), so ``load_averages()`` means the same in either mode (dense on the ps or all-reduced)."""

from __future__ import annotations

from typing import Mapping

import torch

from tensorfleet.errors import InvalidArgumentError


class MovingAverage:
    """Exponential moving averages ("shadows") of variables, as ``tf.train.ExponentialMovingAverage``.

    After update number ``n`` (counted from 0), ``decay_eff = min(decay, (1 + n) / (10 + n))`` and
    ``shadow -= (1 - decay_eff) * (shadow - variable)``; each shadow starts at its variable's
    initial value.  Averaged parameters evaluate better than the last, noisy iterate.
    """

    def __init__(self, decay: float, variables: Mapping[str, torch.Tensor]) -> None:
        if not (isinstance(decay, (int, float)) and 0.0 < decay < 1.0):
            raise InvalidArgumentError(f"moving-average decay {decay!r} must be in (0, 1), e.g. 0.99")
        self.decay = float(decay)
        self._variables = dict(variables)
        self.shadows = {name: value.detach().clone() for name, value in self._variables.items()}

    def update(self, num_updates: int) -> None:
        """Move every shadow toward its variable after update number ``num_updates``."""
        decay = min(self.decay, (1.0 + num_updates) / (10.0 + num_updates))
        with torch.no_grad():
            for name, shadow in self.shadows.items():
                shadow.lerp_(self._variables[name], 1.0 - decay)
