"""Whether a decode step drafts: speculation is kept only where it commits tokens faster than none.

The cost budget sizes a drafted tree (backends.runtime.cost), but it prices every size with the
drafting already paid, so it never chooses not to draft. On a model whose drafts fail, drafting and
verifying a tree cost more than the tokens it adds (docs/experiments.md, "The house, third pass").
The gate compares tokens committed per second: of drafted steps (measured), and of plain steps (one
node, nothing drafted), estimated from each drafted step without its drafting and its extra verify
width, measured where plain steps run. While drafting is ahead, every step drafts; once it falls
behind, steps run plain and a drafted step is tried after `probe` steps, an interval that doubles
while drafting stays behind. It only chooses between two lossless steps: no token depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of a new step in a kind's running rate


@dataclass
class DraftingGate:
    first_probe: int = 4  # plain steps before the first drafted try, after drafting fell behind
    max_probe: int = 64
    probe: int = 4
    until_probe: int = 4
    drafted_rate: float | None = None  # running tokens per second of drafted steps
    plain_rate: float | None = None  # of plain steps (estimated while drafting)

    def drafts(self) -> bool:
        """Whether the next step drafts."""
        if self.drafted_rate is None or self.plain_rate is None or self.drafted_rate >= self.plain_rate:
            return True
        self.until_probe -= 1
        if self.until_probe > 0:
            return False
        self.probe = min(2 * self.probe, self.max_probe)  # a try: the next one waits twice as long
        self.until_probe = self.probe
        return True

    def record(self, drafted: bool, tokens: int, seconds: float, plain_seconds: float | None = None, rows: int = 1
               ) -> None:  # fmt: skip
        """A step committed `tokens` in `seconds`; a drafted step also gives `plain_seconds`, what a
        plain step of its `rows` rows (one token each) would have taken."""
        ahead_before = self._ahead()
        if drafted:
            self.drafted_rate = _smoothed(self.drafted_rate, tokens / max(seconds, 1e-9))
        else:
            self.plain_rate = _smoothed(self.plain_rate, tokens / max(seconds, 1e-9))
        if plain_seconds is not None:
            self.plain_rate = _smoothed(self.plain_rate, rows / max(plain_seconds, 1e-9))
        if ahead_before is False and self._ahead():  # drafting caught up: probes start over next time
            self.probe = self.until_probe = self.first_probe

    def _ahead(self) -> bool | None:
        if self.drafted_rate is None or self.plain_rate is None:
            return None
        return self.drafted_rate >= self.plain_rate


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
