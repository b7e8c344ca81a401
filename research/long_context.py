"""Long inputs the machine already has, for the KV-eviction quality harness (specpass.research.eval_kv).

* Library text: Python standard-library sources, concatenated in a fixed order (the files below, from
  this interpreter's stdlib), cut into token sequences. Evaluation, tuning and training use different files.
* Passkey retrieval in the standard format (Mohtashami & Jaggi; used by StreamingLLM and LongLoRA):
  filler sentences, "The pass key is N. Remember it. N is the pass key." at a chosen depth, and the
  question at the end; the answer is N (exact match).
"""

from __future__ import annotations

import os
import random
import sysconfig

import torch

EVAL_SOURCES = ("argparse.py", "inspect.py", "typing.py", "tarfile.py", "pathlib.py", "subprocess.py",
                "dataclasses.py", "functools.py", "enum.py", "zipfile.py")  # fmt: skip
TUNING_SOURCES = ("textwrap.py", "shutil.py", "tempfile.py", "statistics.py")  # kept apart from the above
TRAINING_SOURCES = ("difflib.py", "configparser.py", "threading.py", "ast.py", "pickle.py", "calendar.py",
                    "smtplib.py", "imaplib.py", "ftplib.py", "locale.py")  # trainers' text (retention gates): apart from both
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def library_text(files: tuple[str, ...] = EVAL_SOURCES) -> str:
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in files:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


def library_sequences(tokenizer, length: int, count: int, files: tuple[str, ...] = EVAL_SOURCES) -> list[torch.Tensor]:
    """`count` disjoint sequences of `length` tokens [length] int64 from the library text."""
    ids = tokenizer(library_text(files), return_tensors="pt").input_ids[0]
    if ids.shape[0] < count * length:
        raise ValueError(f"the library text has {ids.shape[0]} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def passkey_prompt(tokenizer, length: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    """(prompt ids [1, ~length], the pass key) with the key's sentence at `depth` (0 = start, 1 = end)
    of the filler."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    head = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    fixed = len(tokenizer(head + needle + question).input_ids)
    filler_tokens = len(tokenizer(FILLER).input_ids)
    repeats = max(1, (length - fixed) // filler_tokens)
    before = round(repeats * depth)
    text = head + FILLER * before + needle + FILLER * (repeats - before) + question
    return tokenizer(text, return_tensors="pt").input_ids, key
