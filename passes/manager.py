"""Runs passes in dependency order, verifying the graph after each one, and reports what each did."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import networkx as nx
import torch.fx

from ..common.errors import PassMismatchError, PassPipelineError, SpecpassError
from ..ir.capture import copy_step
from ..ir.verify import verify
from .base import CAPTURED, Pass


@dataclass(frozen=True)
class PassRecord:
    pass_name: str
    modified: bool
    summary: str
    nodes_before: int
    nodes_after: int


@dataclass(frozen=True)
class PassReport:
    records: tuple[PassRecord, ...]

    def __str__(self) -> str:
        lines = [
            f"{r.pass_name}: {'modified' if r.modified else 'unchanged'}, "
            f"{r.nodes_before} -> {r.nodes_after} nodes. {r.summary}"
            for r in self.records
        ]
        return "\n".join(lines) or "(no passes)"


def order_passes(passes: Sequence[Pass]) -> list[Pass]:
    """Order passes so that every pass runs after the passes that ensure what it requires.

    Among passes with no constraint between them, the given order is kept.
    """
    names = [p.name for p in passes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PassPipelineError(f"pass listed twice in the pipeline: {', '.join(duplicates)}")
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(passes)))
    provided = {CAPTURED}
    for i, p in enumerate(passes):
        provided |= p.ensures
        for j, q in enumerate(passes):
            if i != j and p.ensures & q.requires:
                dag.add_edge(i, j)
    for p in passes:
        missing = p.requires - provided
        if missing:
            raise PassPipelineError(f"{p.name} requires {sorted(missing)}, which no pass in the pipeline ensures")
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible as exc:
        raise PassPipelineError(f"passes require each other in a cycle: {names}") from exc
    return [passes[i] for i in order]


class PassManager:
    """Applies passes to a copy of a captured graph; the input graph module is never modified."""

    def __init__(self, passes: Sequence[Pass], verifier: Callable[[torch.fx.GraphModule], None] = verify):
        self.passes = order_passes(passes)
        self.verifier = verifier

    def run(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, PassReport]:
        """Each pass: check, rewrite, recompile, then the generic verifier and the own invariants
        (`Pass.verify`) of this pass and of every pass that ran before it."""
        gm = copy_step(gm)
        done: list[str] = []
        applied: list[Pass] = []
        records: list[PassRecord] = []
        for p in self.passes:
            reason = p.check(gm)
            if reason is not None:
                raise PassMismatchError(f"{p.name} does not apply (after {_names(done)}): {reason}")
            before = len(gm.graph.nodes)
            try:
                result = p.rewrite(gm)
                result.graph_module.recompile()
                self.verifier(result.graph_module)
                for q in (*applied, p):
                    q.verify(result.graph_module)
            except SpecpassError as exc:
                raise PassPipelineError(f"{p.name} failed after {_names(done)}: {exc}") from exc
            gm = result.graph_module
            done.append(p.name)
            applied.append(p)
            records.append(PassRecord(p.name, result.modified, result.summary, before, len(gm.graph.nodes)))
        return gm, PassReport(tuple(records))


def _names(done: list[str]) -> str:
    return "passes already run: [" + ", ".join(done) + "]" if done else "no passes already run"
