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
