from dataclasses import dataclass

import pytest
from conftest import tiny_model

from specpass.common.errors import InvalidParameterError, PassMismatchError, PassPipelineError
from specpass.ir import Role, capture, info
from specpass.passes import Pass, PassManager, PassResult, Pipeline, order_passes
from specpass.rewrites import TreeAttention


@dataclass(frozen=True)
class Marker(Pass):
    """Test pass: appends nothing, ensures/requires configurable properties."""

    label: str = "m"

    def check(self, gm):
        return None

    def rewrite(self, gm):
        gm.meta.setdefault("ran", []).append(self.name)
        return PassResult(gm, False, "no change")


class NeedsTree(Marker):
    requires = frozenset({"captured_decode_step", "tree_attention"})


class BreaksGraph(Marker):
    def rewrite(self, gm):
        q = next(n for n in gm.graph.nodes if info(n).role is Role.Q)
        del q.meta["specpass"]
        return PassResult(gm, True, "dropped an annotation")


class Refuses(Marker):
    def check(self, gm):
        return "nothing to do here"


@pytest.fixture(scope="module")
def captured():
    return capture(tiny_model(), cache_size=32)


def test_passes_are_ordered_after_what_they_require():
    ordered = order_passes([NeedsTree(), TreeAttention()])
    assert [p.name for p in ordered] == ["TreeAttention", "NeedsTree"]


def test_unsatisfiable_requirement_and_duplicates_are_rejected():
    with pytest.raises(PassPipelineError, match="requires \\['tree_attention'\\]"):
        Pipeline(NeedsTree())
    with pytest.raises(PassPipelineError, match="listed twice"):
        Pipeline(TreeAttention(), TreeAttention(max_nodes=8))


def test_manager_reports_and_leaves_the_input_graph_alone(captured):
    nodes_before = len(captured.graph.nodes)
    gm, report = PassManager([NeedsTree(), TreeAttention()]).run(captured)
    assert [r.pass_name for r in report.records] == ["TreeAttention", "NeedsTree"]
    assert report.records[0].modified and not report.records[1].modified
    assert gm.meta["ran"] == ["NeedsTree"]
    assert len(captured.graph.nodes) == nodes_before
    assert "TreeAttention: modified" in str(report)


def test_verification_failure_names_the_passes_already_run(captured):
    with pytest.raises(PassPipelineError, match=r"BreaksGraph failed after passes already run: \[TreeAttention\]"):
        PassManager([TreeAttention(), BreaksGraph()]).run(captured)


def test_mismatch_is_reported_and_input_graph_unchanged(captured):
    code = captured.code
    with pytest.raises(PassMismatchError, match="Refuses does not apply .*nothing to do here"):
        PassManager([Refuses()]).run(captured)
    assert captured.code == code


def test_pipeline_is_a_value():
    a = Pipeline(TreeAttention(max_nodes=32))
    assert a == Pipeline(TreeAttention(max_nodes=32)) and a != Pipeline(TreeAttention(max_nodes=16))
    assert repr(a) == "Pipeline(TreeAttention(max_nodes=32))"
    assert Pipeline.from_json(a.to_json()) == a
    assert hash(a) == hash(Pipeline.from_json(a.to_json()))


@pytest.mark.parametrize(
    "text, error, message",
    [
        ('{"passes": [{"pass": "Medusa"}]}', PassPipelineError, "unknown pass 'Medusa'"),
        ('{"passes": [{"pass": "TreeAttention", "params": {"max_nodes": 0}}]}', InvalidParameterError, "max_nodes"),
        ('{"passes": [{"pass": "TreeAttention", "params": {"depth": 3}}]}', InvalidParameterError, "bad parameters"),
        ("[1, 2", PassPipelineError, "does not parse"),
        ('{"pass": []}', PassPipelineError, "a pipeline is"),
    ],
)
def test_invalid_pipelines_are_clear_errors(text, error, message):
    with pytest.raises(error, match=message):
        Pipeline.from_json(text)


def test_pipeline_only_takes_passes():
    with pytest.raises(PassPipelineError, match="takes pass objects"):
        Pipeline("TreeAttention")
