"""Loading GGUF models through the conversion cache (specpass.models): the cached model is the model
transformers converts, weights, config and tokenizer; a second load does not convert; an entry left
incomplete is replaced; a cache that cannot be written only costs the conversion."""

import os

import pytest
import torch

from specpass import models
from specpass.ir.capture import GGUF_ATTRIBUTE
from tests.conftest import tiny_model

TEXTS = ["def fib(n):\n    return n", "Héllo wörld 🤖 \t\n  x", "<|im_start|>user\nhi<|im_end|>"]


def _counting_conversions(monkeypatch) -> list:
    """Wraps models._convert; the list receives each conversion's (model, tokenizer)."""
    done, convert = [], models._convert

    def counted(path, dtype):
        done.append(convert(path, dtype))
        return done[-1]

    monkeypatch.setattr(models, "_convert", counted)
    return done


def _assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    tied = b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()
    assert tied == bool(a.config.tie_word_embeddings)  # the default model's head stays tied
    ignore = {"quantization_config", "_name_or_path", "dtype"}  # de-quantized weights; another folder; as loaded
    ca = {k: v for k, v in a.config.to_dict().items() if k not in ignore}
    assert ca == {k: v for k, v in b.config.to_dict().items() if k not in ignore}
    assert a.generation_config.to_dict() == b.generation_config.to_dict()


def _assert_same_tokenizer(a, b):
    assert all(a(t).input_ids == b(t).input_ids for t in TEXTS)
    assert a.decode(list(range(200, 260))) == b.decode(list(range(200, 260)))
    messages = [{"role": "user", "content": "Summarize: cats sleep a lot."}]
    assert a.apply_chat_template(messages, add_generation_prompt=True) == b.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert a.all_special_tokens == b.all_special_tokens and len(a) == len(b) and a.eos_token_id == b.eos_token_id


def test_the_cached_default_model_is_the_converted_one(tmp_path, monkeypatch):
    """One real conversion of the default GGUF file into an empty cache (about half a minute)."""
    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path))
    conversions = _counting_conversions(monkeypatch)
    model, tokenizer = models.load_default_model()
    assert len(conversions) == 1
    converted, converted_tokenizer = conversions[0]
    assert converted.config.quantization_config is not None  # transformers' own GGUF conversion
    _assert_same_model(converted, model)
    _assert_same_tokenizer(converted_tokenizer, tokenizer)
    assert getattr(model, GGUF_ATTRIBUTE) == os.path.join(models.default_model_dir(), models.GGUF_FILE)
    again, again_tokenizer = models.load_default_model(dtype=torch.bfloat16)
    assert len(conversions) == 1  # read from the cache
    assert again.dtype == torch.bfloat16 and torch.equal(again.lm_head.weight, model.lm_head.weight.bfloat16())
    _assert_same_tokenizer(tokenizer, again_tokenizer)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, default_model):
    """A file standing for a GGUF file whose conversion is a tiny model with the default tokenizer."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    made = []

    def convert(source, dtype):
        made.append(source)
        return tiny_model("llama").to(dtype), default_model[1]

    monkeypatch.setattr(models, "_convert", convert)
    return str(path), made


def test_an_incomplete_entry_is_replaced(tmp_path, monkeypatch, fake_gguf):
    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path / "cache"))
    path, made = fake_gguf
    entry = models._cache_entry(path)
    os.makedirs(entry)
    (tmp_path / "cache" / "gguf" / os.path.basename(entry) / "config.json").write_text("{")  # a killed writer's
    model, _ = models.load_gguf(path)
    assert made == [path] and models._complete(entry)
    _assert_same_model(tiny_model("llama"), model)
    models.load_gguf(path)
    assert made == [path]
    os.utime(path, ns=(1, 1))  # the file changed: a new entry
    models.load_gguf(path)
    assert len(made) == 2 and models._cache_entry(path) != entry


@pytest.mark.parametrize("damage", ["cut short", "deleted", "marker unreadable"])
def test_a_damaged_entry_is_noticed_and_converted_again(tmp_path, monkeypatch, fake_gguf, damage):
    """A cache entry whose files no longer match its marker (a copy cut short after the marker was
    written, a full disk) is converted again with a warning, never read."""
    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path / "cache"))
    path, made = fake_gguf
    models.load_gguf(path)
    entry = models._cache_entry(path)
    weights = os.path.join(entry, "model.safetensors")
    if damage == "cut short":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif damage == "deleted":
        os.remove(weights)
    else:
        with open(os.path.join(entry, models.MARKER), "w") as f:
            f.write("{")
    with pytest.warns(UserWarning, match="damaged"):
        model, _ = models.load_gguf(path)
    assert made == [path, path]
    _assert_same_model(tiny_model("llama"), model)
    models.load_gguf(path)  # whole again: read from the cache
    assert made == [path, path]


def test_an_unwritable_cache_converts_every_time(tmp_path, monkeypatch, fake_gguf):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECPASS_CACHE", str(blocker))
    path, made = fake_gguf
    for _ in range(2):
        model, _ = models.load_gguf(path)
        assert getattr(model, GGUF_ATTRIBUTE) == path
    assert made == [path, path] and blocker.read_text() == ""
