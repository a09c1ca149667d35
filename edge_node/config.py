"""The edge's settings: one value object built from the run profile (`EdgeConfig.from_profile`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from testbed.core.sampling import SamplingParams
from testbed.wire import messages as M
from testbed.wire import protocol as P

# Messages a second per identity (bursts of one second's worth): several times what an honest device sends
# (2-3 a round, probe echoes 10 ms apart) at the fastest rounds seen; numbers in docs/performance.md.
MAX_MSGS_PER_S = 1000.0


@dataclass(frozen=True)
class EdgeConfig:
    """How the edge serves a run; everything but the objects it works with (verifier, controller, channel)."""

    vocab_size: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int = 0
    deadline_s: float = 10.0
    max_misses: int = 2
    max_invalid_payloads: int = 3  # drafts in a row refused by testbed.wire.validate: then the session ends
    straggler_misses: int = 0  # misses in a row that bench a device (`edge_node.bench`); 0: no bench
    max_new_tokens: int = 0
    on_air_vocab_size: int | None = None
    channel_mode: str = "passthrough"
    base_latency_s: float = 0.0
    policy: str = "proposed"
    prompt_texts: list[str] | None = None
    max_array_bytes: int = P.MAX_ARRAY_BYTES
    tx_marker: bool = True
    keys_dir: str | None = None
    heartbeat_s: float = 1.0
    liveness: int = 5
    measure_links: bool = False
    rate_probes: Any = None  # testbed.run.profile.RateProbeSettings
    max_msgs_per_s: float | None = MAX_MSGS_PER_S  # None: no limit
    schedule_ahead: bool = False
    busy_poll: bool = False  # `testbed.runtime.waiting`: a core for no kernel wake-up per message

    def __post_init__(self):
        hb, lv = self.heartbeat_s, self.liveness
        if not (isinstance(hb, (int, float)) and math.isfinite(hb) and M.MIN_HEARTBEAT_S <= hb <= M.MAX_HEARTBEAT_S):
            raise ValueError(f"heartbeat_s={hb!r}; allowed: {M.MIN_HEARTBEAT_S}..{M.MAX_HEARTBEAT_S} s")
        if not (isinstance(lv, int) and 1 <= lv <= M.MAX_LIVENESS):
            raise ValueError(f"liveness={lv!r}; allowed: an integer in 1..{M.MAX_LIVENESS}")
        object.__setattr__(self, "heartbeat_s", float(hb))

    def adapt_deadline(self, deadline_s: float) -> None:
        """The one setting changed once the edge runs (`testbed.run.deadline`: the plan cannot meet the profile's):
        in place, as every part of the edge holds this object."""
        if not (math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"deadline_s={deadline_s!r}; must be a positive number of seconds")
        object.__setattr__(self, "deadline_s", float(deadline_s))

    @property
    def window_s(self) -> float:
        """Silent this long: the peer is dead."""
        return self.liveness * self.heartbeat_s

    @classmethod
    def from_profile(cls, p, *, vocab_size: int, prompt_texts: list[str] | None = None,
                     busy_poll: bool = False) -> EdgeConfig:
        """The edge's settings of a run profile (`testbed.run.profile`)."""
        return cls(vocab_size=vocab_size, sampling=SamplingParams(**p.sampling.model_dump()), seed=p.seed,
                   deadline_s=p.deadline_s, max_misses=p.max_misses, max_new_tokens=p.max_new_tokens,
                   max_invalid_payloads=p.max_invalid_payloads, straggler_misses=p.straggler_misses,
                   on_air_vocab_size=p.on_air_vocab_size, channel_mode=p.channel.mode,
                   base_latency_s=p.channel.base_latency_s, policy=p.policy, prompt_texts=prompt_texts,
                   measure_links=p.channel.measure_links, rate_probes=p.channel.rate_probes,
                   keys_dir=p.keys_dir, heartbeat_s=p.heartbeat_s, liveness=p.liveness,
                   schedule_ahead=p.channel.mode == "passthrough", busy_poll=busy_poll)
