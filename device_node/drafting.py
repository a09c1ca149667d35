"""What a device needs of a draft model: the `Drafter` protocol (in the spirit of Hugging Face's
`CandidateGenerator`), so another drafter plugs into `DeviceNode` without touching the verifier or the wire.

A round, as the device runs it:
    d = drafter.draft(L, params, rng, wire_bits=bits)   # L tokens and the rows they were sampled from
    ... upload d.tokens (and d.wire in UL mode), receive the verdict ...
    drafter.commit(n_accepted, token)                   # keep the accepted prefix, append the edge's token
Losslessness needs one thing of a drafter: each d.tokens[i] is a sample of d.q[i], and d.q[i] is exactly
what the edge reconstructs from d.wire[i] (so sample through the wire precision when `wire_bits` is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from testbed.core.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """What one `Drafter.draft` call drafted."""

    tokens: list[int]  # the n draft tokens, in order
    q: np.ndarray  # (n, V): row i is the distribution tokens[i] was sampled from
    wire: np.ndarray | None = None  # (n, V) at the wire precision, for the upload; None without wire_bits


@runtime_checkable
class Drafter(Protocol):
    """A draft model with its own context; `DeviceNode` drives it one round at a time."""

    vocab_size: int

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new context from these committed tokens (also after a round the edge dropped)."""

    def draft(self, n: int, params: SamplingParams, rng: np.random.Generator, *,
              wire_bits: int | None = None) -> Draft:
        """Sample n tokens after the committed context (uniforms from `rng`); with `wire_bits`, through
        that wire precision: q = exact_from_wire(wire)."""

    def commit(self, n_accepted: int, token: int) -> None:
        """Keep the first n_accepted tokens of the last draft, then `token` (the correction or bonus)."""
