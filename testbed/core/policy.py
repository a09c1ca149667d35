"""The policy interface: what decides each device's mode, draft length and powers for one round.

A policy is any object with ``decide(scenario, context) -> Decision`` (the `Policy` protocol). It sees only
numbers: the `Scenario` with the controller's current estimates in place (acceptance, drafting time, channel
gain per device; the verification and overhead fits), and a `RoundContext` (round index, this round's seed,
the profile's fixed length, and the outcome of the latest round the edge closed). It never sees sockets,
tokens or files. `optimizer.plan` runs a policy, checks its decision (`check_decision`) and has the model
evaluate it; the built-in policies (`optimizer.POLICIES`) are implementations of the same protocol.

A decision the model cannot use raises `PolicyError` naming the policy, the field and the rule; a live run
then plans that round with the controller's fallback policy and records why (docs/extending.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from testbed.core.scenario import Scenario
from testbed.core.vocabulary import MODES, UL, within


class OptimizerError(ValueError):
    """A request the optimizer refuses (unknown policy, problem too big for exhaustive search, a policy's
    unusable decision); `testbed.core.optimizer` exports it."""


class PolicyError(OptimizerError):
    """A policy whose decision cannot be used: wrong shape, a mode that is not UL/DL, a draft length outside
    1..L_max, a power out of range, or an exception raised inside the policy."""


@dataclass(frozen=True)
class DeviceResult:
    """One device's part of a closed round, as the edge measured it."""

    mode: str                   # "UL" or "DL", as scheduled
    draft_len: int              # L_k, as scheduled
    n_accepted: int | None      # accepted draft tokens; None: the device missed the round
    tokens: int | None          # output tokens credited (accepted + correction or bonus); None when missed


@dataclass(frozen=True)
class RoundOutcome:
    """The latest round the edge closed (in a live run the plan of round r is made while round r - 1
    drafts, so this is usually round r - 2), or the previous simulated round in `multispin simulate`."""

    round: int
    devices: Mapping[str, DeviceResult]
    measured_round_s: float | None = None       # s (a virtual channel: the virtual round time)
    measured_goodput_tps: float | None = None   # tokens/s
    predicted_goodput_tps: float | None = None  # tokens/s, what the plan predicted
    fallback: str | None = None                 # why that round fell back to the safe policy, if it did


@dataclass(frozen=True)
class RoundContext:
    """What a policy knows besides the scenario."""

    round: int = 0                       # the round being planned
    seed: int = 0                        # this round's seed (a live run: the run's seed + round)
    fixed_length: int = 4                # the profile's `fixed_length` (only `fixed-length` uses it built in)
    previous: RoundOutcome | None = None  # None: no round closed yet (and in `multispin plan`)


@dataclass(frozen=True)
class Decision:
    """One round's schedule, per device in the scenario's device order.

    modes: "UL" or "DL" (or booleans, True = UL). draft_lens: integers in 1..L_max. ul_powers_w: None = each
    device's P^max (or the power its energy budget allows); else one power per device in [0, P^max] W.
    dl_powers_w: None = the optimal split of downlink_power_w among the DL-mode devices; else one power per
    device (UL-mode entries ignored) summing to at most downlink_power_w over the DL-mode devices.
    ul_bandwidths_hz: only with `ul_access: fdma_shared`; None = the min-max split of the shared uplink for this
    schedule; else one band per device, each >= the scenario's least share, summing to at most the total.
    info: JSON-ready extras recorded with the plan."""

    modes: Sequence
    draft_lens: Sequence
    ul_powers_w: Sequence | None = None
    dl_powers_w: Sequence | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    ul_bandwidths_hz: Sequence | None = None


@runtime_checkable
class Policy(Protocol):
    """Decides one round. Optional attributes read by `multispin plugins`: ``name`` and ``description``."""

    def decide(self, scenario: Scenario, context: RoundContext) -> Decision:
        """The schedule of one round for `scenario` (estimates in place)."""


def policy_name(policy: Any) -> str:
    """A policy's name: its ``name`` attribute, else module:Class of its type."""
    name = getattr(policy, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(policy)
    return f"{cls.__module__}:{cls.__qualname__}"


def check_decision(sc: Scenario, decision: Any, who: str) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    """(ul mask, draft lengths, ul powers or None, dl powers or None) of a decision, or a PolicyError that
    names the policy `who`, the field and what is allowed."""
    n, lmax = sc.num_devices, sc.max_draft_len
    if not isinstance(decision, Decision):
        raise PolicyError(f"policy {who}: decide() returned {type(decision).__name__}, not a Decision")

    def per_device(name: str, values) -> list:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise PolicyError(f"policy {who}: {name} is {type(values).__name__}, not one entry per device")
        if len(values) != n:
            raise PolicyError(f"policy {who}: {name} has {len(values)} entries for {n} devices "
                              f"({', '.join(d.name for d in sc.devices)})")
        return list(values)

    ul = []
    for i, m in enumerate(per_device("modes", decision.modes)):
        if isinstance(m, (bool, np.bool_)):
            ul.append(bool(m))
        elif isinstance(m, str) and m.upper() in MODES:
            ul.append(m.upper() == UL)
        else:
            raise PolicyError(f"policy {who}: modes[{i}] ({sc.devices[i].name}) = {m!r} is not allowed: "
                              f"must be 'UL' or 'DL'")
    lens = []
    for i, v in enumerate(per_device("draft_lens", decision.draft_lens)):
        ok = isinstance(v, (int, np.integer)) or (isinstance(v, (float, np.floating)) and float(v).is_integer())
        if isinstance(v, (bool, np.bool_)) or not ok or not 1 <= v <= lmax:
            raise PolicyError(f"policy {who}: draft_lens[{i}] ({sc.devices[i].name}) = {v!r} is not allowed: "
                              f"must be an integer in 1..{lmax} (max_draft_len)")
        lens.append(int(v))
    ul_mask, L = np.array(ul, bool), np.array(lens, int)
    ul_p = dl_p = None
    if decision.ul_powers_w is not None:
        ul_p = _powers(who, "ul_powers_w", per_device("ul_powers_w", decision.ul_powers_w), sc)
        pmax = sc.device_array("max_power_w")
        for i in np.flatnonzero(~within(ul_p, pmax)):
            raise PolicyError(f"policy {who}: ul_powers_w[{i}] ({sc.devices[i].name}) = {ul_p[i]} W is not allowed: "
                              f"must be in [0, {pmax[i]}] W (the device's max_power_w)")
    if decision.dl_powers_w is not None:
        dl_p = _powers(who, "dl_powers_w", per_device("dl_powers_w", decision.dl_powers_w), sc)
        total = float(dl_p[~ul_mask].sum())
        if sc.dl_access != "tdma" and not within(total, sc.downlink_power_w):
            raise PolicyError(f"policy {who}: dl_powers_w of the DL-mode devices sum to {total:.6g} W, more than "
                              f"downlink_power_w = {sc.downlink_power_w} W")
        if sc.dl_access != "tdma" and np.any(dl_p[~ul_mask] <= 0):
            i = int(np.flatnonzero(~ul_mask & (dl_p <= 0))[0])
            raise PolicyError(f"policy {who}: dl_powers_w[{i}] ({sc.devices[i].name}) = {dl_p[i]} W is not allowed "
                              f"for a DL-mode device: must be > 0 W")
    return ul_mask, L, ul_p, dl_p


def checked_ul_bandwidths(sc: Scenario, decision: Decision, who: str) -> np.ndarray | None:
    """A decision's UL bands (ul_access fdma_shared), checked, or None (the min-max split); a PolicyError names
    the rule."""
    if getattr(decision, "ul_bandwidths_hz", None) is None:
        return None
    if sc.ul_access != "fdma_shared":
        raise PolicyError(f"policy {who}: ul_bandwidths_hz is only allowed with ul_access 'fdma_shared' (this "
                          f"scenario's uplink is dedicated)")
    vals = decision.ul_bandwidths_hz
    if isinstance(vals, (str, bytes)) or not hasattr(vals, "__len__") or len(vals) != sc.num_devices:
        raise PolicyError(f"policy {who}: ul_bandwidths_hz must have one entry per device ({sc.num_devices})")
    b = _powers(who, "ul_bandwidths_hz", list(vals), sc)
    least, total = sc.ul_min_band_hz(), sc.ul_total_bandwidth_hz()
    for i in np.flatnonzero(~within(least, b)):
        raise PolicyError(f"policy {who}: ul_bandwidths_hz[{i}] ({sc.devices[i].name}) = {b[i]} Hz is not allowed: "
                          f"must be >= {least:.6g} Hz (ul_min_share x uplink_total_bandwidth_hz / N)")
    if not within(float(b.sum()), total):
        raise PolicyError(f"policy {who}: ul_bandwidths_hz sum to {b.sum():.6g} Hz, more than "
                          f"uplink_total_bandwidth_hz = {total:.6g} Hz")
    return b


def _powers(who: str, name: str, values: list, sc: Scenario) -> np.ndarray:
    out = []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x >= 0):
            raise PolicyError(f"policy {who}: {name}[{i}] ({sc.devices[i].name}) = {v!r} is not allowed: "
                              f"must be a finite power >= 0 W")
        out.append(x)
    return np.array(out, float)
