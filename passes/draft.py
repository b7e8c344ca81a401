"""Passes that add a draft graph (ir.draft) beside the verify graph, which they leave untouched.

A subclass says what its draft graph is (`build_draft`: the traced graph and its DraftGraphSpec) and
when it applies (`check_draft`); this base adds it to the step, refuses a second draft graph, and
checks after every later pass that the step still carries the draft graph it added (subclasses
extend `verify` with their own invariants). `config_from_dict` rebuilds the spec's config from an
export's manifest.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch.fx

from ..common.errors import GraphVerificationError
from ..ir.draft import DraftGraphSpec, attach_draft, draft_graph, draft_spec
from .base import Pass, PassResult


class DraftGraphPass(Pass):
    """Adds a draft graph; subclasses implement `check_draft` and `build_draft`."""

    @abstractmethod
    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        """None when this draft graph fits `gm`, else why not (`check` has already refused a step that
        has a draft graph)."""

    @abstractmethod
    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        """(the annotated draft graph, its spec, a one-line summary of what it is)."""

    def build_resume(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
        """A cache-sharing draft graph's resume graph (ir.draft); None for a draft graph read by rows."""
        return None

    @classmethod
    def config_from_dict(cls, data: dict) -> Any:
        """The spec's config from its JSON form (DraftGraphSpec.to_dict); default: the dict itself."""
        return data

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        if draft_graph(gm) is not None:
            return f"the step already has a draft graph ({self.name} applied twice, or after another draft pass?)"
        return self.check_draft(gm)

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        draft, spec, summary = self.build_draft(gm)
        attach_draft(gm, draft, spec, self.build_resume(gm))
        return PassResult(gm, True, f"added a draft graph: {summary} ({len(draft.graph.nodes)} nodes)")

    def verify(self, gm: torch.fx.GraphModule) -> None:
        spec = draft_spec(gm)
        if draft_graph(gm) is None or spec is None or spec.source != self.name:
            raise GraphVerificationError(f"the step lost the draft graph {self.name} added")
