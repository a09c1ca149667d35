"""Tokenizer and causal-LM training and evaluation for the built-in model pair (CPU friendly, seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from testbed.core.sampling import RoundRandomness, SamplingParams, sample_from, speculative_round, to_probs

SPECIAL_TOKENS = ["<|endoftext|>"]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (no normaliser: text round-trips exactly)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_documents(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream, documents separated by <|endoftext|>."""
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    kv_heads: int = 0  # 0 = same as heads

    def to_dict(self) -> dict:
        return {"hidden": self.hidden, "layers": self.layers, "heads": self.heads,
                "intermediate": self.intermediate, "kv_heads": self.kv_heads}


def make_model(shape: ModelShape, vocab_size: int, max_positions: int, seed: int):
    """A Llama-style causal LM with tied embeddings, initialised from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads or shape.heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_lm(model, tokens: np.ndarray, *, steps: int, batch: int, context: int, lr: float, seed: int,
             warmup: int = 0, progress=None) -> list[float]:
    """AdamW with linear warm-up and cosine decay on random windows of the token stream; returns losses."""
    if len(tokens) <= context + 1:
        raise ValueError(f"training stream has {len(tokens)} tokens: need more than context+1={context + 1}")
    data = torch.from_numpy(tokens)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = warmup or max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        out = model(input_ids=x[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def _windows(tokens: np.ndarray, context: int, max_tokens: int) -> list[torch.Tensor]:
    n = min(len(tokens), max_tokens + 1)
    out = []
    for s in range(0, n - 1, context):
        w = tokens[s:min(s + context + 1, n)]
        if len(w) >= 2:
            out.append(torch.from_numpy(w.copy()))
    return out


@torch.no_grad()
def perplexity(model, tokens: np.ndarray, context: int, max_tokens: int) -> float:
    nll, count = 0.0, 0
    for w in _windows(tokens, context, max_tokens):
        logits = model(input_ids=w[None, :-1]).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
        count += len(w) - 1
    return math.exp(nll / count)


@torch.no_grad()
def teacher_forced_acceptance(target, draft, tokens: np.ndarray, context: int, max_tokens: int,
                              params: SamplingParams) -> float:
    """Mean over held-out positions of sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    total, count = 0.0, 0
    for w in _windows(tokens, context, max_tokens):
        p = to_probs(target(input_ids=w[None, :-1]).logits[0].double().numpy(), params)
        q = to_probs(draft(input_ids=w[None, :-1]).logits[0].double().numpy(), params)
        total += float(np.minimum(p, q).sum())
        count += p.shape[0]
    return total / count


@torch.no_grad()
def speculative_generate(target, draft, prompt: list[int], new_tokens: int, draft_len: int,
                         params: SamplingParams, seed: int, device_name: str = "eval") -> tuple[list[int], list[int]]:
    """Reference speculative decoding with full recomputation (no caches): returns (tokens, accepted per round).

    Used to measure the pair's acceptance and as the ground truth for the cached drafter/verifier paths.
    """
    ctx = list(prompt)
    accepted_counts: list[int] = []
    rnd = 0
    while len(ctx) - len(prompt) < new_tokens:
        rr = RoundRandomness(seed, device_name, rnd)
        rng = rr.draft_generator()
        drafts, q_rows = [], []
        for _ in range(draft_len):
            logits = draft(input_ids=torch.tensor([ctx + drafts])).logits[0, -1].double().numpy()
            q = to_probs(logits, params)
            drafts.append(sample_from(q, float(rng.random())))
            q_rows.append(q)
        logits = target(input_ids=torch.tensor([ctx + drafts])).logits[0, -(draft_len + 1):].double().numpy()
        p_rows = to_probs(logits, params)
        n_acc, nxt = speculative_round(drafts, np.stack(q_rows), p_rows, rr)
        ctx.extend(drafts[:n_acc] + [nxt])
        accepted_counts.append(n_acc)
        rnd += 1
    return ctx[len(prompt):len(prompt) + new_tokens], accepted_counts


@torch.no_grad()
def greedy_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(new_tokens):
        ctx.append(int(model(input_ids=torch.tensor([ctx])).logits[0, -1].argmax()))
    return ctx[len(prompt):]


def acceptance_summary(accepted_counts: list[int], draft_len: int) -> dict:
    """alpha by maximum likelihood for a truncated geometric (accepted / (accepted + rejections))."""
    acc = int(sum(accepted_counts))
    rejections = sum(1 for a in accepted_counts if a < draft_len)
    rounds = len(accepted_counts)
    return {
        "rounds": rounds,
        "alpha": acc / (acc + rejections) if acc + rejections else float("nan"),
        "accepted_fraction": acc / (rounds * draft_len) if rounds else float("nan"),
        "tokens_per_target_call": (acc + rounds) / rounds if rounds else float("nan"),
    }
