"""The device's draft model under onnxruntime, with its KV cache (numpy + onnxruntime only: no torch).

The ONNX graph comes from `model_pairs.onnx_export` (inputs input_ids, position_ids, past_key_i, past_value_i;
outputs logits, present_key_i, present_value_i). Cache bookkeeping:
  committed context = tokens in the cache + `pending` tokens not fed yet (the prompt at first, later the
  round's correction/bonus token, and the last draft when all drafts were accepted).
`draft` feeds the pending tokens and then each draft token but the last; `commit` slices the cache back to
the accepted prefix, so a rejected round costs no recomputation. `OnnxDrafter` is a `Drafter`
(`device_node.drafting`).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

from device_node.drafting import Draft
from testbed.core.sampling import WIRE_DTYPES, SamplingParams, exact_from_wire, sample_from, to_probs, to_wire_precision


class OnnxDrafter:
    """The `Drafter` of a device: an ONNX causal LM with a KV cache under onnxruntime (CPU).

    `last_logits` (n, V) keeps the raw logits of the last draft, for checks against PyTorch.
    """

    def __init__(self, onnx_path, *, threads: int = 1) -> None:
        path = Path(onnx_path)
        if not path.is_file():
            raise FileNotFoundError(f"draft ONNX model not found: {path}")
        if int(threads) != threads or threads < 1:
            raise ValueError(f"threads={threads!r}: must be an integer >= 1")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own types (InvalidProtobuf, Fail, ...) derive from Exception only
            raise ValueError(f"{path}: not a loadable ONNX model: {exc}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        for required in ("input_ids", "position_ids", "past_key_0", "past_value_0"):
            if required not in inputs:
                raise ValueError(f"{path}: ONNX input {required!r} missing; export it with tools/export_onnx.py")
        self.n_layers = len([n for n in inputs if re.fullmatch(r"past_key_\d+", n)])
        shape = inputs["past_key_0"].shape  # (1, kv_heads, past, head_dim)
        if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
            raise ValueError(f"{path}: past_key_0 has shape {shape}; kv heads and head dim must be static")
        self.kv_heads, self.head_dim = shape[1], shape[3]
        self.output_names = [o.name for o in self.session.get_outputs()]
        v = self.session.get_outputs()[0].shape[-1]
        self.vocab_size: int = v if isinstance(v, int) else self._probe_vocab()
        self._past_names = [f"past_{k}_{i}" for i in range(self.n_layers) for k in ("key", "value")]
        self._cache, self._cached, self._pending, self._context = self._empty_cache(), [], [], []
        self._last_drafts: list[int] | None = None
        self.last_logits: np.ndarray | None = None

    def share(self) -> OnnxDrafter:
        """A drafter on this one's onnxruntime session with a context of its own (empty until `reset`): the
        devices of one process (`device_node.host`) load the model once. `InferenceSession.run` is thread-safe."""
        twin = copy.copy(self)  # the session and the model's shapes; the state is replaced below
        twin._cache, twin._cached, twin._pending, twin._context = twin._empty_cache(), [], [], []
        twin._last_drafts, twin.last_logits = None, None
        return twin

    def _empty_cache(self) -> list[np.ndarray]:
        return [np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32) for _ in self._past_names]

    def _probe_vocab(self) -> int:
        feeds = {"input_ids": np.zeros((1, 1), np.int64), "position_ids": np.zeros((1, 1), np.int64)}
        for name in (f"past_{k}_{i}" for i in range(self.n_layers) for k in ("key", "value")):
            feeds[name] = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
        return int(self.session.run(["logits"], feeds)[0].shape[-1])

    # -- state -------------------------------------------------------------------------------------------
    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new context: nothing cached, the whole prompt pending."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty: need at least one token")
        self._check_ids("prompt_ids", ids)
        self._cache = self._empty_cache()
        self._cached: list[int] = []  # tokens whose keys/values are in the cache
        self._pending = ids  # committed, not yet fed
        self._context = list(ids)  # all committed tokens
        self._last_drafts: list[int] | None = None
        self.last_logits: np.ndarray | None = None

    def prefill(self) -> None:
        """Feed the pending committed tokens but the last into the cache now (a session's prompt, between its
        registration and its first schedule): round 0's draft then costs what every round's does, one pending
        token and a forward per draft, instead of also the prompt's prefill. The drafts are the same."""
        if self._last_drafts is None and len(self._pending) > 1:
            self._feed(self._pending[:-1])
            self._pending = self._pending[-1:]

    @property
    def context(self) -> list[int]:
        """All committed tokens (prompt + accepted drafts + corrections/bonuses)."""
        return list(self._context)

    @property
    def cache_length(self) -> int:
        return len(self._cached)

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids {bad[:5]} outside [0, {self.vocab_size})")

    def _feed(self, ids: list[int]) -> np.ndarray:
        """Run the model on ids after the cache; append to the cache; return logits (len(ids), V)."""
        start = len(self._cached)
        feeds = {"input_ids": np.asarray([ids], np.int64),
                 "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None]}
        feeds.update(zip(self._past_names, self._cache))
        out = self.session.run(None, feeds)
        self._cache = out[1:]
        self._cached.extend(ids)
        return out[0][0]

    # -- drafting ----------------------------------------------------------------------------------------
    def draft(self, n: int, params: SamplingParams, rng: np.random.Generator, *,
              wire_bits: int | None = None) -> Draft:
        """Sample n draft tokens; returns them with q (n, V), the rows they were sampled from.

        Without `wire_bits`: q is float32 `to_probs` of the logits and `wire` is None. With it: each row is
        cast to the wire precision (`wire`, for the upload) and q = exact_from_wire of it (float64), which is
        what the edge reconstructs from those bytes, so the token is sampled from the very q it verifies.
        """
        if int(n) != n or n < 1:
            raise ValueError(f"n={n!r}: draft length must be an integer >= 1")
        if wire_bits is not None and wire_bits not in WIRE_DTYPES:
            raise ValueError(f"wire_bits={wire_bits!r}: not a wire precision; allowed: None, {sorted(WIRE_DTYPES)}")
        if self._last_drafts is not None:
            raise RuntimeError("draft() called twice without commit(): commit the previous round first")
        if not self._pending:
            raise RuntimeError("draft() before reset(prompt_ids)")
        logits_rows = []
        tokens: list[int] = []
        q_rows = np.empty((n, self.vocab_size), np.float32 if wire_bits is None else np.float64)
        wire = None if wire_bits is None else np.empty((n, self.vocab_size), WIRE_DTYPES[wire_bits])
        logits = self._feed(self._pending)[-1]
        self._pending = []
        for i in range(n):
            logits_rows.append(logits)
            q = to_probs(logits.astype(np.float32), params)
            if wire is not None:
                wire[i] = to_wire_precision(q, wire_bits)
                q = exact_from_wire(wire[i])
            q_rows[i] = q
            tokens.append(sample_from(q_rows[i], float(rng.random())))
            if i + 1 < n:  # the last draft is fed next round, once we know whether it was accepted
                logits = self._feed([tokens[-1]])[-1]
        self._last_drafts = tokens
        self.last_logits = np.stack(logits_rows)
        return Draft(tokens, q_rows, wire)

    def commit(self, n_accepted: int, token: int) -> None:
        """Keep context + the first n_accepted drafts, then append token (fed at the next draft)."""
        drafts = self._last_drafts
        if drafts is None:
            raise RuntimeError("commit() without a preceding draft()")
        if int(n_accepted) != n_accepted or not 0 <= n_accepted <= len(drafts):
            raise ValueError(f"n_accepted={n_accepted!r}: must be in 0..{len(drafts)}")
        self._check_ids("token", [int(token)])
        base = len(self._cached) - (len(drafts) - 1)  # cache length before the drafts were fed
        keep = base + min(n_accepted, len(drafts) - 1)
        self._cache = [c[:, :, :keep, :] for c in self._cache]
        del self._cached[keep:]
        self._pending = drafts[len(self._cached) - base:n_accepted] + [int(token)]
        self._context.extend(drafts[:n_accepted] + [int(token)])
        self._last_drafts = None

    def logits_trace(self, tokens: list[int]) -> np.ndarray:
        """Logits (len(tokens), V) for a whole sequence from an empty cache, one token per call (the decode
        path), leaving the drafter's state untouched: the reference for the ONNX-vs-PyTorch check."""
        saved = (self._cache, self._cached, self._pending, self._context, self._last_drafts, self.last_logits)
        try:
            self._cache, self._cached = self._empty_cache(), []
            return np.stack([self._feed([int(t)])[-1] for t in tokens])
        finally:
            self._cache, self._cached, self._pending, self._context, self._last_drafts, self.last_logits = saved
