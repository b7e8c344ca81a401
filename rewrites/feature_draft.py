"""Feature draft: a trained draft over the target's states added to the step: EAGLE-3's
(heads.feature_draft), Clover's (heads.clover) or Chimera's (heads.chimera), chosen by the trained
draft's design.

Papers: EAGLE, EAGLE-2, EAGLE-3 (Li et al.); Clover (Xiao et al.); Chimera (Zeng et al.). For a draft
over feature layers (EAGLE-3's) the verify graph gains one declared output (ir.draft.add_step_output),
DRAFT_STATES [B, T, H]: the draft's `fuse` over the residual streams entering its three feature layers,
computed where those states are; a draft without feature layers (Clover's, Chimera's) reads the final
normed states every step already returns, and the verify graph stays as it is. Either
way the step's other outputs stay bit for bit. The step gains a draft graph of kind "feature"
(`heads.feature_draft.FeatureDraftStep`): one call of the draft over its own KV cache, passed in and
returned, with the model's token embedding (shared). On ONNX the declared output is one more output of
model.onnx and the draft graph is draft.onnx (backends.onnx.draft). Refused, graph unchanged: a draft
trained for another model, feature layers the model lacks, a second draft graph. `verify` checks the
output is the fuse over exactly those streams (and that a draft without feature layers declares none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError, SpecpassError
from ..ir import arch_of
from ..ir.draft import DRAFT_STATES, FEATURE_KIND, ROWS, DraftGraphSpec, DraftTensor, add_step_output, draft_spec, step_output, trace_draft
from ..ir.roles import Role, annotate
from ..ir.split import layer_output
from ..passes.draft import DraftGraphPass
from ..passes.export import ExportHook

FEATURE_DRAFT = "feature_draft"
FUSE_MODULE = "feature_fuse"  # the step's submodule: the draft's fuse


@dataclass(frozen=True)
class FeatureDraft(DraftGraphPass):
    """draft: a `specpass train-heads --kind feature` directory, or "default" for the draft shipped for
    the embedded default model."""

    draft: str = "default"

    ensures = frozenset({FEATURE_DRAFT})

    def __post_init__(self):
        if not isinstance(self.draft, str) or not self.draft:
            raise InvalidParameterError(f"FeatureDraft.draft must be a directory or 'default', got {self.draft!r}")

    def directory(self) -> str:
        from ..heads.io import shipped_heads

        return shipped_heads("feature") if self.draft == "default" else self.draft

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype) -> ExportHook:
        """Nothing beside the step: the declared output is the step's, the draft graph is draft.onnx."""
        return ExportHook()

    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        from ..heads.io import model_mismatch, read_feature_config

        try:
            config = read_feature_config(self.directory())
        except SpecpassError as exc:
            return str(exc)
        mismatch = model_mismatch("feature draft", self.directory(), config.model, config.hidden_size,
                                  config.vocab_size, gm)  # fmt: skip
        if mismatch is not None:
            return mismatch
        depth = arch_of(gm).num_layers
        if not all(1 <= layer < depth for layer in config.feature_layers):
            return (f"the feature draft in {self.directory()} reads the streams entering layers {config.feature_layers}; "
                    f"the pass taps layers 1 .. {depth - 1} of this {depth}-layer model")  # fmt: skip
        return None

    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        """The draft graph and its spec; the verify graph gains its `features` output here too (it needs
        the loaded draft's fuse)."""
        from ..heads.feature_draft import FeatureDraftStep
        from ..heads.io import load_feature_draft

        layer = load_feature_draft(self.directory(), gm.get_submodule("lm_head"))
        config = layer.config
        if config.feature_layers:
            self._add_features(gm, layer.fuse, config.feature_layers)
        draft = trace_draft(FeatureDraftStep(layer, gm.get_submodule("embed_tokens")), {"embed_tokens": Role.EMBED})
        arch = arch_of(gm)
        h, kv, d, vocab = config.hidden_size, config.num_kv_heads, config.head_dim, config.draft_vocab
        spec = DraftGraphSpec(
            kind=FEATURE_KIND,
            source=self.name,
            inputs=(
                DraftTensor("tokens", (ROWS, "T"), "int64", bound=arch.vocab_size),
                DraftTensor("states", (ROWS, "T", h), "model"),
                DraftTensor("positions", (ROWS, "T"), "int64"),
                DraftTensor("past_keys", (ROWS, kv, "S", d), "model"),
                DraftTensor("past_values", (ROWS, kv, "S", d), "model"),
                DraftTensor("mask", (ROWS, "T", "S+T"), "bool"),
                DraftTensor("depth", (ROWS, "T"), "int64", bound=2),
                DraftTensor("previous", (ROWS, "T", 2), "int64", bound=arch.vocab_size),
            ),
            outputs=(
                DraftTensor("new_states", (ROWS, "T", h), "model"),
                DraftTensor("logits", (ROWS, "T", vocab), "model"),
                DraftTensor("vocab", (vocab,), "int64"),
                DraftTensor("keys", (ROWS, kv, "S+T", d), "model"),
                DraftTensor("values", (ROWS, kv, "S+T", d), "model"),
            ),
            config=config,
        )
        what = {"eagle3": f"a feature draft layer over layers {config.feature_layers}",
                "clover": "a Clover draft (augmenting block, regressive heads)",
                "chimera": f"a Chimera draft (trigram encoder, full-context decoder, {config.parallel_heads} "
                           "residual heads)"}[config.design]  # fmt: skip
        return draft, spec, f"{what}, {vocab} draft tokens"

    @staticmethod
    def _add_features(gm: torch.fx.GraphModule, fuse: torch.nn.Module, layers: tuple[int, ...]) -> None:
        """The verify graph's `features` output: fuse(cat(streams entering `layers`)) [B, T, H]."""
        graph = gm.graph
        streams = [layer_output(graph, layer - 1) for layer in layers]  # [B, T, H] each
        gm.add_submodule(FUSE_MODULE, fuse)
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            joined = annotate(graph.call_function(torch.cat, (streams, -1)), Role.DRAFT)  # [B, T, 3H]
            fused = annotate(graph.call_module(FUSE_MODULE, (joined,)), Role.DRAFT)  # [B, T, H]
        add_step_output(gm, fused, DRAFT_STATES)

    @classmethod
    def config_from_dict(cls, data: dict):
        from ..heads.feature_draft import FeatureDraftConfig

        data = dict(data, accuracy=tuple(tuple(row) for row in data.get("accuracy", ())),
                    feature_layers=tuple(data["feature_layers"]))  # fmt: skip
        return FeatureDraftConfig(**data)

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """A draft over feature layers: the step outputs `features`, its fuse over the streams entering
        the draft's three layers; a draft without (Clover's, Chimera's): the step declares no such
        output (its draft reads the final normed states)."""
        super().verify(gm)
        fused = step_output(gm, DRAFT_STATES)
        config = draft_spec(gm).config
        if not config.feature_layers:
            if fused is not None:
                _fail(f"a {config.design} draft reads the final normed states, but the step declares {DRAFT_STATES!r}")
            return
        if fused is None or fused.op != "call_module" or fused.target != FUSE_MODULE:
            _fail(f"the step lost its declared output {DRAFT_STATES!r} (the draft's fuse over its feature layers)")
        joined = fused.args[0]
        layers = config.feature_layers
        expected = [layer_output(gm.graph, layer - 1) for layer in layers]
        if joined.target is not torch.cat or list(joined.args[0]) != expected:
            _fail(f"the {DRAFT_STATES!r} output does not read the streams entering layers {layers}")


def _fail(message: str) -> None:
    raise GraphVerificationError(f"FeatureDraft: {message}")
