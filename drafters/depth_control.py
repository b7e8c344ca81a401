"""Adaptive self-drafting: each step, how deep a chain the early-exit draft should run, 0 meaning off
(DEL-style: by expected tokens per second, from measured acceptance and measured cost).

    tokens(d) = rest_tokens + sum_{i=1..d} prod_{j<=i} a_j      seconds(d) = rest_on + (d + 1) * call_seconds
    tokens(0) = tokens_off                                      seconds(0) = rest_off

a_j: the running acceptance rate of the chain's j-th token given the one before; call_seconds: a draft
call's wall time; rest_on / rest_off: the rest of a step with the chain on / off (they differ: a resumed
verify skips the layers below the exit); rest_tokens / tokens_off: tokens a step emits besides the chain
/ with it off. All are running averages; until both arms are measured, one is estimated from the other.
Both arms are measured, never assumed: one step off every `probe_every` on; while off, a one-token probe
after `probe_every` steps, the wait doubling (up to LONGEST_WAIT) after each probe that leaves it off.
"""

from __future__ import annotations

from collections.abc import Sequence

SMOOTHING = 0.2  # weight of the newest step in the running averages
LONGEST_WAIT = 64  # steps off between probes, at most


class DepthController:
    """Chooses the self-draft's chain depth each step; `measure` feeds it each finished step."""

    def __init__(self, max_depth: int, probe_every: int = 8):
        self.max_depth, self.probe_every = max_depth, probe_every
        self.call_seconds: float | None = None
        self.rest_on: float | None = None
        self.rest_off: float | None = None
        self.rest_tokens: float | None = None
        self.tokens_off: float | None = None
        self.resumed = False  # whether the last step with the chain on was verified by resuming
        self.off_steps = 0  # consecutive steps chosen off
        self.on_steps = 0  # consecutive steps chosen on
        self.wait = probe_every  # steps off before the next probe

    def expected_rate(self, depth: int, rates: Sequence[float]) -> float:
        """Expected tokens per second of a step with a chain of `depth` (module docstring)."""
        gain, reach = 0.0, 1.0
        for a in rates[:depth]:
            reach *= a
            gain += reach
        lower = self.call_seconds if self.resumed else 0.0  # the lower layers a resumed step leaves to the draft
        if depth:
            rest_on = self.rest_on if self.rest_on is not None else max(self.rest_off - lower, 0.0)
            tokens, seconds = self.rest_tokens + gain, rest_on + (depth + 1) * self.call_seconds
        else:
            tokens = self.tokens_off if self.tokens_off is not None else self.rest_tokens
            seconds = self.rest_off if self.rest_off is not None else self.rest_on + lower
        return tokens / max(seconds, 1e-9)

    def choose(self, rates: Sequence[float]) -> int:
        """The depth for the next step; rates[j - 1] = a_j for j = 1..max_depth."""
        if self.call_seconds is None or self.rest_tokens is None:
            return self.max_depth  # nothing measured on yet: draft, and measure
        if self.rest_off is None:
            return 0  # nothing measured off yet
        best = max(range(self.max_depth + 1), key=lambda d: (self.expected_rate(d, rates), -d))
        if best:
            self.off_steps, self.wait = 0, self.probe_every
            self.on_steps += 1
            if self.on_steps > self.probe_every:  # keep the off arm's measurement fresh
                self.on_steps = 0
                return 0
            return best
        self.on_steps = 0
        if self.off_steps >= self.wait:  # long enough off: look again
            self.off_steps, self.wait = 0, min(2 * self.wait, LONGEST_WAIT)
            return 1
        self.off_steps += 1
        return 0

    def measure(self, step_seconds: float, calls: int, call_seconds: float, emitted: int, from_chain: int,
                resumed: bool = False) -> None:  # fmt: skip
        """One finished step: its wall time, this session's draft calls in it and their total time,
        the tokens it emitted, how many of them the chain gave, and whether it was verified by resuming."""
        rest = max(step_seconds - call_seconds, 0.0)
        if calls:
            self.call_seconds = _average(self.call_seconds, call_seconds / calls)
            self.rest_on, self.resumed = _average(self.rest_on, rest), resumed
            self.rest_tokens = _average(self.rest_tokens, float(emitted - from_chain))
        else:
            self.rest_off = _average(self.rest_off, rest)
            self.tokens_off = _average(self.tokens_off, float(emitted))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
