"""Damaged trained files (Medusa and Hydra heads, the exit adapter, the feature draft, a recovered ladder)
give one line naming the file and how to make it again, never a safetensors or JSON traceback. (The
conversion cache: test_models.py; exports: test_onnx.py, test_heads.py, test_kv_eviction.py; compiled
packages, compiled again: test_gguf_compiled.py.)"""

import os
import shutil

import pytest

import specpass
from conftest import tiny_model
from specpass.heads import load_heads, shipped_heads
from specpass.heads.exit_adapter import load_exit_adapter
from specpass.heads.io import load_feature_draft


def _cut_short(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garble(path: str) -> None:
    with open(path, "w") as f:
        f.write("{")


LOADERS = {"hydra": load_heads, "medusa": load_heads, "exit_adapter": load_exit_adapter, "feature": load_feature_draft}
HINTS = {"hydra": "train-heads", "medusa": "train-heads", "exit_adapter": "exit-adapter", "feature": "train-heads --kind feature"}
FILES = {"hydra": ("heads.safetensors", "heads.json"), "medusa": ("heads.safetensors", "heads.json"),
         "exit_adapter": ("exit_adapter.safetensors", "exit_adapter.json"),
         "feature": ("feature_draft.safetensors", "feature_draft.json")}  # fmt: skip


@pytest.mark.parametrize("damage", [_cut_short, _garble])
@pytest.mark.parametrize("kind", list(LOADERS))
def test_damaged_trained_files_are_one_clear_error(default_model, tmp_path, kind, damage):
    """Each shipped draft module's weights cut short, and its JSON garbled: one line naming the file and
    how to make it again."""
    model, _ = default_model
    directory = str(tmp_path / kind)
    shutil.copytree(shipped_heads(kind), directory)
    name = FILES[kind][0] if damage is _cut_short else FILES[kind][1]
    damage(os.path.join(directory, name))
    with pytest.raises(specpass.DamagedFileError, match=name) as raised:
        LOADERS[kind](directory, model.lm_head)
    message = str(raised.value)
    assert HINTS[kind] in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("damage", [_cut_short, _garble])
def test_damaged_ladder_files_are_one_clear_error(tmp_path, damage):
    from specpass.research.ladder_training import CONFIG, WEIGHTS, load_recovered, save_recovered
    from specpass.rewrites import LadderResidual

    model = tiny_model("llama")
    directory = str(tmp_path / "ladder")
    save_recovered(model, LadderResidual((1,)), directory)
    load_recovered(model, directory)  # whole, it loads
    name = WEIGHTS if damage is _cut_short else CONFIG
    damage(os.path.join(directory, name))
    with pytest.raises(specpass.DamagedFileError, match=name) as raised:
        load_recovered(model, directory)
    assert "recover_ladder" in str(raised.value) and len(str(raised.value).splitlines()) == 1
