"""Loading real checkpoints: a local Hugging Face directory or a GGUF file (dequantized by transformers,
which needs the `gguf` and `accelerate` packages: `pip install multispin-testbed[gguf]`)."""

from __future__ import annotations

from pathlib import Path


def _torch_dtype(dtype, device: str):
    import torch

    if dtype is None:
        return torch.float32  # exact comparisons; pass bfloat16/float16 for speed on a GPU
    if isinstance(dtype, str):
        table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                 "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
        if dtype not in table:
            raise ValueError(f"dtype={dtype!r}: allowed {sorted(table)}")
        return table[dtype]
    return dtype


def is_gguf(path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


def load_causal_lm(path_or_dir, device: str = "cpu", dtype=None):
    """AutoModelForCausalLM from an HF directory (config.json + weights) or a .gguf file."""
    from transformers import AutoModelForCausalLM

    p = Path(path_or_dir).expanduser()
    td = _torch_dtype(dtype, device)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a Hugging Face model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=td)
    elif is_gguf(p):
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("loading GGUF needs the `gguf` and `accelerate` packages "
                               "(pip install 'multispin-testbed[gguf]')") from exc
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=td)
    else:
        raise FileNotFoundError(f"{p}: neither a Hugging Face model directory nor a .gguf file")
    return model.to(device).eval()


def gguf_to_hf_dir(gguf_path, out_dir, dtype="float32") -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face directory (weights + tokenizer.json)."""
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model = load_causal_lm(gguf_path, device="cpu", dtype=dtype)
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    return out_dir


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument: `cache` in newer transformers 5.x, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
