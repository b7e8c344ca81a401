"""Damaged trained files (draft heads, the exit adapter) give one line naming the file and how to make
it again, never a safetensors or JSON traceback. (The conversion cache: test_models.py; exports:
test_onnx.py.)"""

import os
import shutil

import pytest

import specpass
from specpass.heads import load_heads, shipped_heads
from specpass.heads.exit_adapter import load_exit_adapter


def _cut_short(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garble(path: str) -> None:
    with open(path, "w") as f:
        f.write("{")


@pytest.mark.parametrize(
    ("kind", "name", "damage", "hint"),
    [("hydra", "heads.safetensors", _cut_short, "train-heads"), ("hydra", "heads.json", _garble, "train-heads"),
     ("exit_adapter", "exit_adapter.safetensors", _cut_short, "exit-adapter"),
     ("exit_adapter", "exit_adapter.json", _garble, "exit-adapter")],
)  # fmt: skip
def test_damaged_heads_and_adapters_are_one_clear_error(default_model, tmp_path, kind, name, damage, hint):
    model, _ = default_model
    directory = str(tmp_path / kind)
    shutil.copytree(shipped_heads(kind), directory)
    damage(os.path.join(directory, name))
    load = load_heads if kind == "hydra" else load_exit_adapter
    with pytest.raises(specpass.DamagedFileError, match=name) as raised:
        load(directory, model.lm_head)
    message = str(raised.value)
    assert hint in message and len(message.splitlines()) == 1
