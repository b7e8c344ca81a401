"""Decode benchmark (same as `specpass bench`): python benchmarks/decode.py [--prompts N] [--max-new-tokens N]."""

import sys

from specpass.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
