"""Export a draft model (Hugging Face directory or GGUF file) to ONNX with a KV cache for the device.

  python tools/export_onnx.py --model DIR_OR_GGUF --out draft.onnx [--exporter auto|dynamo|torchscript] [--check]

Same as `multispin models export`.
"""

import sys

from testbed.cli import main

if __name__ == "__main__":
    sys.exit(main(["models", "export", *sys.argv[1:]]))
