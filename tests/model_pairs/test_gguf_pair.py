"""A user's own pair from GGUF files (docs/models.md): a tiny random Qwen2 target and draft written with
gguf.GGUFWriter (llama.cpp's tensor names, as convert_hf_to_gguf writes them), loaded back through
`model_pairs.checkpoints.load_causal_lm` (what the edge's `load_target` and the ONNX export use) and
converted with `gguf_to_hf_dir`: the logits are those of the Hugging Face model the weights came from."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the [gguf] extra (pip install 'multispin-testbed[gguf]')")
pytest.importorskip("accelerate", reason="the [gguf] extra (pip install 'multispin-testbed[gguf]')")

from model_pairs.checkpoints import gguf_to_hf_dir, load_causal_lm  # noqa: E402

VOCAB = 96


def _qwen2(hidden: int, layers: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms and biases too, so a wrong mapping cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _write_gguf(model, path) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}  # transformers 5 keeps rope_theta there
    w.add_rope_freq_base(float(rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w.add_tensor(name, t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_synthetic_gguf_pair_loads_with_the_logits_of_its_weights(tmp_path):
    ids = torch.tensor([[1, 5, 9, 42, 7, 88, 3, 60]])
    for role, hidden, layers, seed in (("target", 64, 2, 0), ("draft", 32, 1, 1)):
        ref = _qwen2(hidden, layers, seed)
        path = tmp_path / f"{role}.gguf"
        _write_gguf(ref, path)
        loaded = load_causal_lm(path)
        assert loaded.config.model_type == "qwen2" and loaded.config.vocab_size == VOCAB
        assert loaded.config.num_hidden_layers == layers and loaded.config.num_key_value_heads == 2
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            got = loaded(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if role == "draft":  # the fetch path: GGUF -> Hugging Face folder (weights written, then the tokenizer,
            # which this synthetic file lacks: a real GGUF carries one) -> the same loader
            with pytest.raises(ValueError, match="tokenizer"):
                gguf_to_hf_dir(path, tmp_path / "draft")
            hf = load_causal_lm(tmp_path / "draft")
            with torch.no_grad():
                torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
