"""A draft graph's buckets for CUDA-graph replay (backends.lowering.draft_buckets): the padding and the
cut on the CPU. The padded call of the real draft graphs: tests/test_feature_draft.py and
tests/test_heads.py; the replay itself: tests/test_gpu.py."""

import pytest
import torch

from specpass.backends.lowering.draft_buckets import CudaGraphDraft, bucket_of, cut_outputs, named_sizes, pad_inputs
from specpass.ir.draft import ROWS, DraftGraphSpec, DraftTensor

SHAPES = {"tokens": (ROWS, "T"), "keys": (ROWS, 2, "S", 3), "mask": (ROWS, "T", "S+T"), "vocab": (5,)}
DTYPES = {"tokens": "int64", "keys": "model", "mask": "bool", "vocab": "int64"}


def _spec(shares_cache: bool = False) -> DraftGraphSpec:
    """A spec whose outputs mirror its inputs (a feature draft's kinds of axes), so a cut undoes a pad."""
    inputs = tuple(DraftTensor(name, shape, DTYPES[name]) for name, shape in SHAPES.items())
    outputs = tuple(DraftTensor(f"{name}_out", shape, DTYPES[name]) for name, shape in SHAPES.items())
    return DraftGraphSpec("feature", "Test", inputs, outputs, config=None, shares_cache=shares_cache)


def _inputs(rows: int, t: int, s: int) -> dict:
    gen = torch.Generator().manual_seed(rows * 100 + t * 10 + s)
    return {"tokens": torch.randint(1, 96, (rows, t), generator=gen), "keys": torch.randn(rows, 2, s, 3, generator=gen),
            "mask": torch.rand(rows, t, s + t, generator=gen) > 0.3, "vocab": torch.arange(5)}  # fmt: skip


def test_each_named_size_rounds_up_to_a_power_of_two():
    assert named_sizes(_spec(), _inputs(3, 5, 300)) == {ROWS: 3, "T": 5, "S": 300}
    assert bucket_of({ROWS: 3, "T": 5, "S": 300}) == {ROWS: 4, "T": 8, "S": 512}
    assert bucket_of({ROWS: 4, "T": 1, "S": 256}) == {ROWS: 4, "T": 1, "S": 256}  # already a bucket: unchanged


def test_inputs_that_disagree_on_a_size_are_refused():
    inputs = _inputs(3, 5, 7)
    inputs["tokens"] = inputs["tokens"][:, :4]
    with pytest.raises(ValueError, match="'mask' has T = 5, another input 4"):
        named_sizes(_spec(), inputs)


@pytest.mark.parametrize("rows, t, s", [(3, 3, 5), (1, 1, 0), (4, 4, 8), (5, 2, 300)])
def test_padding_puts_each_part_at_the_start_of_its_block_and_the_cut_undoes_it(rows, t, s):
    spec, inputs = _spec(), _inputs(rows, t, s)
    sizes = named_sizes(spec, inputs)
    buckets = bucket_of(sizes)
    padded = pad_inputs(spec, inputs, buckets, sizes)
    rb, tb, sb = buckets[ROWS], buckets["T"], buckets["S"]
    assert padded["mask"].shape == (rb, tb, sb + tb) and padded["keys"].shape == (rb, 2, sb, 3)
    mask = padded["mask"]
    assert torch.equal(mask[:rows, :t, :s], inputs["mask"][:, :, :s])  # the S part first
    assert torch.equal(mask[:rows, :t, sb : sb + t], inputs["mask"][:, :, s:])  # the T part at the start of its block
    assert int(mask.sum()) == int(inputs["mask"].sum())  # nothing else attends: every padded entry is False
    assert torch.equal(padded["tokens"][:rows, :t], inputs["tokens"]) and int(padded["tokens"][rows:].abs().sum()) == 0
    assert torch.equal(padded["vocab"], inputs["vocab"])  # a fixed size is not padded
    outputs = tuple(padded[name] for name in SHAPES)
    cut = cut_outputs(spec, outputs, buckets, sizes)
    assert all(torch.equal(c, inputs[name]) for c, name in zip(cut, SHAPES))
    assert all(c.untyped_storage().data_ptr() != o.untyped_storage().data_ptr() for c, o in zip(cut, outputs))


def test_a_cache_sharing_draft_graph_is_not_replayed_by_rows():
    with pytest.raises(ValueError, match="runs as a step"):
        CudaGraphDraft(eager=None, spec=_spec(shares_cache=True))
