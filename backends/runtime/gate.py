"""Whether a decode step drafts: speculation is kept only where it commits tokens faster than none.

The cost budget sizes a drafted tree (backends.runtime.cost), but it prices every size with the
drafting already paid, so it never chooses not to draft. On a model whose drafts fail, drafting and
verifying a tree cost more than the tokens it adds (docs/experiments.md, "The house, third pass").
The gate measures both kinds of step, tokens committed per second over the last `window` steps of
each: drafted steps, and plain steps (one node a row, nothing drafted). A step's tokens vary from one
to a whole branch, so steps draft until `evidence` drafted steps, or fewer holding `evidence_rows`
rows' outcomes (a batch's step is many rows' evidence); then one plain step is measured, and from
there the faster kind runs, the other tried after `probe` steps, an interval that doubles (up to
`max_probe`; at once when one kind is `clear_lead` times faster) while the same kind stays faster.
Drafting counts as faster while within `tolerance` of plain steps: a drafter's acceptance can jump
(a loop, a quoted passage) and a plain-favouring gate sees it only at its next try. Both kinds are
measured, none estimated: a plain step's cost cannot be told from a drafted one's (what the loop
spends on a node besides the forward grows with the tree). It only chooses between two lossless
steps: no token depends on it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftingGate:
    window: int = 8  # steps of each kind the rates are summed over
    evidence: int = 8  # drafted steps before the gate may stop drafting
    evidence_rows: int = 32  # or drafted steps of this many rows in all
    first_probe: int = 4  # steps of the faster kind before the first try of the other
    max_probe: int = 32
    clear_lead: float = 2.0  # a kind this many times faster than the other needs no try of it
    tolerance: float = 0.1  # drafting stays the faster kind while within this fraction of plain steps' rate
    drafted: deque = field(default_factory=deque)  # (tokens, seconds) of the last drafted steps
    plain: deque = field(default_factory=deque)  # (tokens, seconds) of the last plain steps
    drafted_rows: int = 0  # rows of every drafted step so far
    favoured: bool | None = None  # whether drafted steps were the faster kind at the last decision
    probe: int = 0  # steps of the faster kind between two tries of the other
    until_probe: int = 0

    def drafts(self) -> bool:
        """Whether the next step drafts."""
        if len(self.drafted) < self.evidence and self.drafted_rows < self.evidence_rows:
            return True
        if not self.plain:
            return False  # drafting has its evidence: measure a plain step
        favoured = self.drafting_is_faster()
        if favoured != self.favoured:  # the faster kind changed: the tries start over
            self.favoured, self.probe, self.until_probe = favoured, self.first_probe, self.first_probe
        self.until_probe -= 1
        if self.until_probe > 0:
            return favoured
        rates = _rate(self.drafted), _rate(self.plain)
        if self.probe < self.max_probe and max(rates) >= self.clear_lead * min(rates):
            self.probe = self.until_probe = self.max_probe  # far behind: the next try waits the longest
            return favoured
        self.probe = min(2 * self.probe, self.max_probe)  # a try: the next one waits twice as long
        self.until_probe = self.probe
        return not favoured

    def record(self, drafted: bool, tokens: int, seconds: float, rows: int = 1) -> None:
        """A step of `rows` rows committed `tokens` in `seconds`."""
        _append(self.drafted if drafted else self.plain, (tokens, max(seconds, 1e-9)), self.window)
        self.drafted_rows += rows if drafted else 0

    def drafting_is_faster(self) -> bool:
        """Drafted steps commit tokens at least as fast as plain ones (True while either is unmeasured)."""
        if not self.drafted or not self.plain:
            return True
        return _rate(self.drafted) * (1.0 + self.tolerance) >= _rate(self.plain)


def _append(steps: deque, step: tuple[int, float], window: int) -> None:
    steps.append(step)
    if len(steps) > window:
        steps.popleft()


def _rate(steps: deque) -> float:
    return sum(t for t, _ in steps) / sum(s for _, s in steps)
