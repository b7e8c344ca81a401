"""Whether a decode step drafts: speculation is kept only where it commits tokens faster than none.

The cost budget sizes a drafted tree (backends.runtime.cost), but it prices every size with the
drafting already paid, so it never chooses not to draft. On a model whose drafts fail, drafting and
verifying a tree cost more than the tokens it adds (docs/experiments.md, "The house, third pass").
The gate compares tokens committed per second over the last `window` steps of each kind: drafted
steps (measured), and plain steps (one node, nothing drafted: estimated from each drafted step
without its drafting and its extra verify width, measured where plain steps run). A step's tokens
vary from one to a whole branch, so it decides only after `evidence` drafted steps, or fewer steps
holding `evidence_rows` rows' outcomes (a batch's step is many rows' evidence); while drafting is
ahead every step drafts; once behind, steps run plain and a drafted step is tried after `probe`
steps, an interval that doubles (up to `max_probe`) while drafting stays behind. It only chooses
between two lossless steps: no token depends on it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftingGate:
    window: int = 8  # steps of each kind the rates are summed over
    evidence: int = 4  # drafted steps before the gate may stop drafting
    evidence_rows: int = 32  # or drafted steps of this many rows in all
    first_probe: int = 4  # plain steps before the first drafted try, once drafting fell behind
    max_probe: int = 32
    probe: int = 4
    until_probe: int = 4
    drafted: deque = field(default_factory=deque)  # (tokens, seconds) of the last drafted steps
    drafted_rows: int = 0  # rows of every drafted step so far
    plain: deque = field(default_factory=deque)  # (tokens, seconds) of plain steps, run or estimated

    def drafts(self) -> bool:
        """Whether the next step drafts."""
        if self.ahead():
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
        behind_before = not self.ahead()
        _append(self.drafted if drafted else self.plain, (tokens, seconds), self.window)
        self.drafted_rows += rows if drafted else 0
        if plain_seconds is not None:
            _append(self.plain, (rows, max(plain_seconds, 1e-9)), self.window)
        if behind_before and self.ahead():  # drafting caught up: tries start over when it next falls behind
            self.probe = self.until_probe = self.first_probe

    def ahead(self) -> bool:
        """Drafting is ahead, or there is not yet the evidence to say it is not."""
        if (len(self.drafted) < self.evidence and self.drafted_rows < self.evidence_rows) or not self.plain:
            return True
        return _rate(self.drafted) >= _rate(self.plain)


def _append(steps: deque, step: tuple[int, float], window: int) -> None:
    steps.append(step)
    if len(steps) > window:
        steps.popleft()


def _rate(steps: deque) -> float:
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)
