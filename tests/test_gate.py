"""The drafting gate (backends.runtime.gate): a step drafts only where drafted steps commit tokens faster
than plain ones; a step that does not draft is as lossless as one that does."""

import pytest
import torch
from conftest import peaked_tiny_model

import specpass
from specpass.backends.runtime import gate as gate_module
from specpass.backends.runtime.gate import DraftingGate
from specpass.drafters import Suffix


def test_the_gate_drafts_until_the_evidence_says_plain_steps_are_faster_then_tries_ever_less_often():
    gate = DraftingGate(window=4, evidence=3, first_probe=2, max_probe=8, probe=2, until_probe=2)
    for _ in range(2):  # drafts fail, but two steps are not evidence yet
        assert gate.drafts()
        gate.record(True, tokens=10, seconds=1.0, plain_seconds=0.5, rows=10)  # 10 tokens/s drafted, 20 plain
    assert gate.drafts()
    gate.record(True, tokens=10, seconds=1.0, plain_seconds=0.5, rows=10)
    choices = []
    for _ in range(16):  # behind: plain steps; drafted tries 4, then 8 steps apart (the interval doubles, capped)
        drafted = gate.drafts()
        choices.append(drafted)
        if drafted:
            gate.record(True, tokens=10, seconds=1.0, plain_seconds=0.5, rows=10)
        else:
            gate.record(False, tokens=10, seconds=0.5)
    assert [i for i, c in enumerate(choices) if c] == [1, 5, 13]
    for _ in range(4):  # drafting pays again: the window fills with fast drafted steps
        gate.record(True, tokens=100, seconds=1.0, plain_seconds=0.5, rows=10)
    assert gate.drafts() and gate.probe == 2  # drafting again; the tries start over next time


def test_a_wide_batch_step_is_evidence_enough():
    """One drafted step of 32 rows holds 32 rows' outcomes: the gate may stop drafting after it; a step
    of 8 rows is not, and four of them are."""
    wide = DraftingGate()
    wide.record(True, tokens=32, seconds=2.0, plain_seconds=1.0, rows=32)  # nothing accepted, twice the time
    assert not wide.ahead()
    narrow = DraftingGate()
    for step in range(4):
        assert narrow.ahead(), step
        narrow.record(True, tokens=8, seconds=2.0, plain_seconds=1.0, rows=8)
    assert not narrow.ahead()


@pytest.mark.parametrize("drafter", [None, Suffix()], ids=["default", "suffix"])
def test_steps_that_do_not_draft_equal_hf_greedy_in_a_batch(monkeypatch, drafter):
    """The gate forced to alternate: rows of different lengths (left padding) under the cost budget equal
    HF greedy, with drafted and plain steps both run, for the default drafter (all rows at once) and for
    one that drafts row by row through its sessions (Suffix)."""
    choices = []

    def alternate(self):
        choices.append(len(choices) % 2 == 0)
        return choices[-1]

    monkeypatch.setattr(gate_module.DraftingGate, "drafts", alternate)
    model = peaked_tiny_model()
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 96, (n,), generator=gen) for n in (9, 14)]
    rows = [torch.cat([r, r[:5]]) for r in rows]  # a repeat for prompt lookup
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :], mask[b, width - len(r) :] = r, 1
    options = {"lowering": "eager"} | ({"drafter": drafter} if drafter is not None else {})
    program = specpass.compile_program(model, options, rows=2)
    out = specpass.generate(program, ids, 20, attention_mask=mask, eos_token_id=[])
    for b, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert list(out.new_tokens[b]) == alone[0, len(r) :].tolist(), b
    assert any(choices) and not all(choices)  # drafted and plain steps both ran
