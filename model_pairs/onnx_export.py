"""Export a Hugging Face causal LM (the draft) to ONNX with an explicit KV cache.

Graph signature (what `device_node.drafter.OnnxDrafter` runs):
  inputs:  input_ids (1, S) int64, position_ids (1, S) int64, past_key_i / past_value_i (1, H_kv, T, D) float32
  outputs: logits (1, S, V) float32, present_key_i / present_value_i (1, H_kv, T + S, D) float32
Prefill is a call with T = 0; decode a call with S = 1; rollback is slicing the presents along T.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class KVWrapper(torch.nn.Module):
    """(input_ids, position_ids, *past) -> (logits, *present) around transformers' DynamicCache."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers
        from model_pairs.checkpoints import cache_kwarg

        self.cache_kw = cache_kwarg(model)

    def forward(self, input_ids, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)])
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{self.cache_kw: cache})
        present = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        flat = []
        for layer in present.layers:
            flat.extend([layer.keys, layer.values])
        return (out.logits, *flat)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a HF decoder config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv, head_dim


def export_draft_onnx(model, out_path: Path, *, opset: int = 18, dynamo: bool | None = None) -> dict:
    """Write the ONNX graph to out_path (external data when > 2 GB); returns {exporter, seconds}.

    Tries the dynamo exporter first and falls back to the legacy TorchScript one.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = model.float().eval()
    model.config.use_cache = True
    model.config._attn_implementation = "sdpa"
    wrapper = KVWrapper(model).eval()
    n_layers, kv, hd = kv_geometry(model.config)
    # Example sizes other than 0 and 1, or the exporter specialises the dynamic dimensions.
    s, t = 3, 5
    ids = torch.randint(0, model.config.vocab_size, (1, s))
    pos = torch.arange(t, t + s)[None]
    past = []
    for _ in range(n_layers):
        past += [torch.randn(1, kv, t, hd), torch.randn(1, kv, t, hd)]
    in_names = ["input_ids", "position_ids"]
    out_names = ["logits"]
    for i in range(n_layers):
        in_names += [f"past_key_{i}", f"past_value_{i}"]
        out_names += [f"present_key_{i}", f"present_value_{i}"]
    big = sum(p.numel() for p in model.parameters()) * 4 > 1.8e9
    attempts = [True, False] if dynamo is None else [dynamo]
    errors = []
    for use_dynamo in attempts:
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                if use_dynamo:
                    from torch.export import Dim

                    seq, past_len = Dim("seq", min=1, max=65536), Dim("past", min=0, max=65536)
                    dyn = ({1: seq}, {1: seq}, tuple({2: past_len} for _ in range(2 * n_layers)))
                    torch.onnx.export(
                        wrapper, (ids, pos, *past), str(out_path), input_names=in_names,
                        output_names=out_names, dynamic_shapes=dyn, dynamo=True, opset_version=opset,
                        external_data=big, verbose=False)
                else:
                    axes = {"input_ids": {1: "seq"}, "position_ids": {1: "seq"}, "logits": {1: "seq"}}
                    for i in range(n_layers):
                        for kind in ("key", "value"):
                            axes[f"past_{kind}_{i}"] = {2: "past"}
                            axes[f"present_{kind}_{i}"] = {2: "total"}
                    torch.onnx.export(
                        wrapper, (ids, pos, *past), str(out_path), input_names=in_names,
                        output_names=out_names, dynamic_axes=axes, dynamo=False,
                        opset_version=min(opset, 17))
            return {"exporter": "dynamo" if use_dynamo else "torchscript",
                    "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as exc:  # noqa: BLE001 - report every exporter's failure together
            errors.append(f"{'dynamo' if use_dynamo else 'torchscript'}: {type(exc).__name__}: {exc}")
            log.warning("ONNX export with %s failed: %s", "dynamo" if use_dynamo else "torchscript", exc)
    raise RuntimeError("ONNX export failed: " + " | ".join(e[:500] for e in errors))


QUANTIZE_CHOICES = ("int8",)


def quantize_draft_onnx(src: Path, dst: Path, mode: str = "int8") -> dict:
    """Dynamic int8 quantization (onnxruntime.quantization.quantize_dynamic) of an exported draft: int8
    weights of the MatMul/Gather ops, activations quantized per call. Inputs and outputs keep their float32
    names and shapes, so `device_node.drafter.OnnxDrafter` runs the result unchanged. Returns
    {quantize, seconds, bytes_before, bytes_after}."""
    if mode not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={mode!r}: allowed {', '.join(QUANTIZE_CHOICES)}")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: the quantized draft must not overwrite its float32 source")
    dst.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    before = src.stat().st_size + sum(p.stat().st_size for p in src.parent.glob(src.name + ".data"))
    large = before > 1.8e9
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic logs a "consider pre-processing" warning on the root logger
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                             use_external_data_format=large)
    finally:
        root.setLevel(level)
    after = dst.stat().st_size + sum(p.stat().st_size for p in dst.parent.glob(dst.name + ".data"))
    return {"quantize": mode, "seconds": round(time.perf_counter() - t0, 2), "bytes_before": before,
            "bytes_after": after}
