"""Batched verification of several devices' drafts with one PyTorch forward pass.

Each session (device) keeps its own KV cache. Invariant: every committed token except the `held` ones is in
the cache, and at least one committed token is always held back, so the next forward has a query at the
position that scores the first draft. A batch is laid out as

    [ left-padded past (T = max cached length) | right-padded new tokens (S = max held+pending+drafts) ]

with a 2-D attention mask that hides the padding and per-row position ids, so devices with different
context and draft lengths share one forward. The per-session slices of the new cache are stashed and
`commit` trims them to the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from model_pairs.checkpoints import cache_kwarg


@runtime_checkable
class Verifier(Protocol):
    """What the edge server needs of a target model (`BatchedVerifier` is the PyTorch one): batched scoring
    of many devices' drafts, each device a session with its own cache. Another runtime or model family plugs
    in by implementing these five members; accept/reject, the wire and the records stay the edge's.

    A round: ``verify([(session, pending_ids, draft_ids), ...])`` scores every device's drafts in one call,
    then ``commit(session, n_accepted)`` per device keeps its context + pending + the accepted drafts."""

    vocab_size: int  # V of the target's distributions; devices must register with the same

    def open(self, session: str, prompt_ids: list[int]) -> None:
        """Start (or restart) a session from its prompt."""

    def close(self, session: str) -> None:
        """Forget a session and free its cache (unknown sessions are ignored)."""

    def verify(self, items: list[tuple[str, list[int], list[int]]]) -> list[np.ndarray]:
        """Per item, (L + 1, V) target logits: row i scores draft i given the context, pending tokens (committed
        tokens not yet scored, e.g. the device's own correction) and drafts 0..i-1; row L is the bonus
        position. Each session at most once per call, and commit() before it is verified again."""

    def commit(self, session: str, n_accepted: int) -> None:
        """Keep the first n_accepted drafts of the last verify (0..L) after the pending tokens."""


@dataclass
class _Session:
    keys: list  # per layer (1, H_kv, T, D)
    values: list
    held: list[int]  # committed tokens not in the cache (always >= 1 between rounds)
    proposal: tuple | None = None  # (keys, values, new_ids, n_prefix) from the last verify, until commit
    context_len: int = 0  # committed tokens in total

    @property
    def cached(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Below this many parameters a target's ops take microseconds: a second intra-op thread only adds a barrier, and
# when another process holds a core the barrier waits for a descheduled thread (micro pair, 2 cores: verify
# 1.1 ms on 1 thread, 2.0 ms on 2 quiet, 28-48 ms on 2 with the other core busy; docs/performance.md).
SMALL_TARGET_PARAMS = 50_000_000


def auto_threads(model) -> int | None:
    """The `threads: auto` of a target: 1 below SMALL_TARGET_PARAMS, else None (torch's default)."""
    return 1 if sum(p.numel() for p in model.parameters()) < SMALL_TARGET_PARAMS else None


class BatchedVerifier:
    def __init__(self, model, device: str | None = None, *, threads: int | str | None = None) -> None:
        if threads == "auto":
            threads = auto_threads(model)
        if threads is not None:
            if isinstance(threads, str) or int(threads) != threads or threads < 1:
                raise ValueError(f"threads={threads!r}: must be an integer >= 1, auto or None")
            torch.set_num_threads(int(threads))
        self.device = torch.device(device or default_device())
        self.model = model.to(self.device).eval()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.n_layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.dtype = next(model.parameters()).dtype
        self.sessions: dict[str, _Session] = {}
        self._cache_kw = cache_kwarg(model)

    def describe(self) -> dict:
        """What meta.json records of the target: its precision, device and torch's CPU threads."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "threads": torch.get_num_threads()}

    # -- sessions ----------------------------------------------------------------------------------------
    def open(self, session: str, prompt_ids: list[int]) -> None:
        """Start (or restart) a session; the prompt is prefilled at the first verify."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError(f"session {session!r}: prompt_ids is empty, need at least one token")
        self._check_ids(session, "prompt_ids", ids)
        empty = [torch.zeros((1, self.kv_heads, 0, self.head_dim), dtype=self.dtype, device=self.device)
                 for _ in range(self.n_layers)]
        self.sessions[session] = _Session(list(empty), list(empty), ids, None, len(ids))

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    def extra_positions(self, session: str) -> int:
        """Positions the session's next verify computes beyond its L + 1: its committed tokens not in the cache
        but one (a new session's whole prompt, its prefill); 0 for an unknown session. The edge's plan adds
        them to the verification time (`Controller.prefill_positions`)."""
        s = self.sessions.get(session)
        return max(0, len(s.held) - 1) if s is not None else 0

    def context_length(self, session: str) -> int:
        return self._get(session).context_len

    def _get(self, session: str) -> _Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise KeyError(f"session {session!r} is not open (open: {sorted(self.sessions)})") from None

    def _check_ids(self, session: str, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"session {session!r}: {name} ids {bad[:5]} outside [0, {self.vocab_size})")

    # -- verification ------------------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self, items: list[tuple[str, list[int], list[int]]]) -> list[np.ndarray]:
        """One forward for all items; per item the target logits (L+1, V) float32 scoring the L drafts and
        the bonus position."""
        if not items:
            return []
        names = [it[0] for it in items]
        if len(set(names)) != len(names):
            raise ValueError(f"sessions {names}: each session at most once per batch")
        rows = []
        for name, pending, drafts in items:
            s = self._get(name)
            if s.proposal is not None:
                raise RuntimeError(f"session {name!r}: verify() again before commit() of the last round")
            pending, drafts = [int(t) for t in pending], [int(t) for t in drafts]
            self._check_ids(name, "pending_ids", pending)
            self._check_ids(name, "draft_ids", drafts)
            prefix = s.held + pending
            rows.append((s, prefix + drafts, len(prefix), len(drafts)))

        b = len(rows)
        t_max = max(r[0].cached for r in rows)
        s_max = max(len(r[1]) for r in rows)
        dev = self.device
        input_ids = torch.zeros((b, s_max), dtype=torch.long, device=dev)
        position_ids = torch.zeros((b, s_max), dtype=torch.long, device=dev)
        mask = torch.zeros((b, t_max + s_max), dtype=torch.long, device=dev)
        past = []
        for layer in range(self.n_layers):
            k = torch.zeros((b, self.kv_heads, t_max, self.head_dim), dtype=self.dtype, device=dev)
            v = torch.zeros_like(k)
            for i, (s, _, _, _) in enumerate(rows):
                t = s.cached
                if t:
                    k[i, :, t_max - t:] = s.keys[layer][0]
                    v[i, :, t_max - t:] = s.values[layer][0]
            past.append((k, v))
        for i, (s, new, _, _) in enumerate(rows):
            t, n = s.cached, len(new)
            input_ids[i, :n] = torch.tensor(new, dtype=torch.long)
            position_ids[i] = torch.arange(t, t + s_max)  # padded tail continues counting: never attended
            mask[i, t_max - t:t_max + n] = 1

        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=past)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kw: cache})
        present = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        logits = out.logits.float()
        results = []
        for i, (s, new, n_prefix, n_drafts) in enumerate(rows):
            t = s.cached
            lo, hi = t_max - t, t_max + len(new)
            keys = [layer.keys[i:i + 1, :, lo:hi].clone() for layer in present.layers]
            values = [layer.values[i:i + 1, :, lo:hi].clone() for layer in present.layers]
            s.proposal = (keys, values, new, n_prefix, n_drafts)
            results.append(logits[i, n_prefix - 1:n_prefix + n_drafts].cpu().numpy())
        return results

    def commit(self, session: str, n_accepted: int) -> None:
        """Keep context + pending + the first n_accepted drafts; the last kept token is held for next time."""
        s = self._get(session)
        if s.proposal is None:
            raise RuntimeError(f"session {session!r}: commit() without a preceding verify()")
        keys, values, new, n_prefix, n_drafts = s.proposal
        if int(n_accepted) != n_accepted or not 0 <= n_accepted <= n_drafts:
            raise ValueError(f"session {session!r}: n_accepted={n_accepted!r} must be in 0..{n_drafts}")
        committed = n_prefix + int(n_accepted)  # new tokens now part of the context (>= 1)
        keep = s.cached + committed - 1
        s.keys = [k[:, :, :keep] for k in keys]
        s.values = [v[:, :, :keep] for v in values]
        s.held = [new[committed - 1]]
        s.context_len = keep + 1
        s.proposal = None


def load_target(path_or_dir, device: str | None = None, dtype=None):
    """A target causal LM from a Hugging Face directory or a GGUF file (see model_pairs.checkpoints)."""
    from model_pairs.checkpoints import load_causal_lm

    return load_causal_lm(path_or_dir, device=device or default_device(), dtype=dtype)
