"""Running acceptance estimates: P(a drafted node is accepted | its parent was accepted), per key."""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class AcceptanceStats:
    """Beta-smoothed acceptance rate per key (e.g. a candidate's rank), starting from prior rates."""

    def __init__(self, priors: Mapping[Hashable, float], default: float, strength: float = 8.0):
        self.priors = dict(priors)
        self.default = default
        self.strength = strength
        self.accepted: dict[Hashable, float] = {}
        self.tried: dict[Hashable, float] = {}

    def rate(self, key: Hashable) -> float:
        prior = self.priors.get(key, self.default)
        tried = self.tried.get(key, 0.0)
        return (self.accepted.get(key, 0.0) + prior * self.strength) / (tried + self.strength)

    def record(self, key: Hashable, accepted: bool) -> None:
        self.tried[key] = self.tried.get(key, 0.0) + 1.0
        self.accepted[key] = self.accepted.get(key, 0.0) + float(accepted)


class ProbabilityCalibration:
    """Running calibration of a drafter's own probabilities, per key (e.g. a draft head) and decile.

    calibrated(key, p) = min(p * ratio, 1), where ratio = (accepted + strength) / (drafted mass + strength)
    over the drafts of that key whose probability fell in p's decile: accepted drafts against the
    probability the drafter gave them. It starts at 1 (trust the drafter) and moves as outcomes come
    in: the heads' raw probabilities are overconfident (docs/experiments.md, "Calibration of the heads'
    probabilities").
    """

    def __init__(self, bins: int = 10, strength: float = 2.0):
        self.bins = bins
        self.strength = strength
        self.accepted: dict[tuple[Hashable, int], float] = {}
        self.mass: dict[tuple[Hashable, int], float] = {}

    def _bin(self, key: Hashable, prob: float) -> tuple[Hashable, int]:
        return key, min(int(prob * self.bins), self.bins - 1)

    def __call__(self, key: Hashable, prob: float) -> float:
        cell = self._bin(key, prob)
        ratio = (self.accepted.get(cell, 0.0) + self.strength) / (self.mass.get(cell, 0.0) + self.strength)
        return min(prob * ratio, 1.0)

    def record(self, key: Hashable, prob: float, accepted: bool) -> None:
        cell = self._bin(key, prob)
        self.accepted[cell] = self.accepted.get(cell, 0.0) + float(accepted)
        self.mass[cell] = self.mass.get(cell, 0.0) + prob
