"""The per-round controller (runs in the edge process): online estimates -> plan -> predictions.

Pure logic (no sockets, no clocks): the edge server feeds it observations and asks it for a plan.
- alpha_k: Beta posterior mean; prior mean = the profile's acceptance, `alpha_prior_trials` pseudo-trials.
  A round with n accepted out of L is n successes and (1 if n < L) failure: per-token Bernoulli trials
  up to and including the first rejection.
- t_k: median of the last `draft_time_window` device-reported drafting times per token (they include the
  emulated slowdown; a median because a shared CPU adds rare long stalls), seeded from the profile's
  draft_time_s times the device's compute_scale.
- g_k: from the channel state (`channel_emulator.state.ChannelState`) per round, or the scenario's static
  gains.
- T_ver = t0 + t1 * sum(L+1): least-squares refit from the measured verification times once there are
  enough rounds with different batch sizes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from testbed.core.model import evaluate
from testbed.core.optimizer import DevicePlan, Plan, plan
from testbed.core.scenario import Scenario


@dataclass
class DeviceEstimate:
    alpha_prior: float
    prior_trials: float
    draft_time_s: float
    successes: float = 0.0
    trials: float = 0.0
    rounds_timed: int = 0
    recent: list = field(default_factory=list)

    @property
    def alpha(self) -> float:
        a = self.alpha_prior * self.prior_trials + self.successes
        n = self.prior_trials + self.trials
        return self.alpha_prior if n <= 0 else a / n


@dataclass
class RoundPlan:
    round: int
    devices: list[str]
    plan: dict                       # Plan.to_dict() of the optimizer
    scenario: Scenario               # what the plan was computed on (estimates in place)
    estimates: dict[str, dict]       # name -> {alpha, draft_time_s, gain_db}
    per_device: dict[str, DevicePlan] = field(default_factory=dict)  # name -> the plan's device entry


@dataclass
class DeviceOutcome:
    """What the edge saw of one device that drafted in time: the measured side of its round record."""

    n_accepted: int
    tokens: int                       # accepted + the correction or bonus token
    dl_payload: str                   # what the verdict carried: "token", or "p" (a DL-mode correction)
    ul_channel: dict | None           # the emulator's annotation of the upload (None without an emulator)
    ul_bytes: int                     # the edge's count of the upload (recorded when no emulator annotates it)
    dl_bytes: int                     # bytes of the verdict as sent
    up_phase_s: float                 # edge clock: schedule sent -> draft arrived
    t_verdict: float                  # edge clock (monotonic) when the verdict left
    timings: dict = field(default_factory=dict)  # the device's own: draft_s, compute_s, emulated_extra_s, ...
    # From the device's report, once it comes:
    dl_channel: dict | None = None    # the emulator's annotation of the verdict's downlink
    correction_s: float | None = None
    report_s: float | None = None     # verdict sent -> report received
    report_late: bool = False         # no report before the round closed: the verdict is unconfirmed, and the
    #                                   record credits none of its tokens (the device may never have had them)


class Controller:
    def __init__(self, scenario: Scenario, *, policy: str = "proposed", fixed_length: int = 4, seed: int = 0,
                 channel_state=None, compute_scale: dict[str, float] | None = None,
                 alpha_prior_trials: float = 8.0, draft_time_window: int = 10, fit_verify_after: int = 5,
                 pin_mode: str | None = None, pin_draft_len: int | None = None, fit_round_overhead: bool = True):
        self.base = scenario
        self.pin_mode, self.pin_draft_len = pin_mode, pin_draft_len
        self.policy, self.fixed_length, self.seed = policy, fixed_length, seed
        self.channel_state = channel_state
        self.window = max(1, int(draft_time_window))
        self.fit_verify_after = fit_verify_after
        scale = compute_scale or {}
        self.est: dict[str, DeviceEstimate] = {
            d.name: DeviceEstimate(d.acceptance, alpha_prior_trials, d.draft_time_s * scale.get(d.name, 1.0))
            for d in scenario.devices
        }
        self.static_gains = dict(zip([d.name for d in scenario.devices], scenario.gains_db().tolist()))
        self.t0, self.t1 = scenario.verify_t0_s, scenario.verify_t1_s
        # Observation windows are bounded: an edge runs for days, and only the recent ones are used.
        self._verify_obs: deque[tuple[float, float]] = deque(maxlen=200)
        # T_0 (spec section 4): the round's fixed overhead (messages, scheduling) the model does not see.
        self.fit_round_overhead = fit_round_overhead
        self.round_overhead_s = scenario.round_overhead_s
        self._overhead_obs: deque[float] = deque(maxlen=20)
        # Protocol header bits per message: measured from what the channel charged for draft uploads.
        self.header_bits = scenario.header_bits
        self._header_obs: deque[float] = deque(maxlen=50)

    # -- estimates -------------------------------------------------------------------------------
    def gains_db(self, round_index: int, t_s: float) -> dict[str, float]:
        if self.channel_state is None:
            return dict(self.static_gains)
        return self.channel_state.gains_db(round_index, t_s)

    def observe_acceptance(self, name: str, n_accepted: int, draft_len: int) -> None:
        e = self.est[name]
        e.successes += n_accepted
        e.trials += n_accepted + (1 if n_accepted < draft_len else 0)

    def observe_draft_time(self, name: str, draft_s: float, draft_len: int) -> None:
        if not (draft_s > 0 and draft_len > 0 and math.isfinite(draft_s)):  # a device's own report
            return
        e = self.est[name]
        e.rounds_timed += 1
        if e.rounds_timed == 1:
            return  # the first draft also prefills the prompt and warms the runtime up: not a per-token time
        e.recent = (e.recent + [draft_s / draft_len])[-self.window:]
        e.draft_time_s = float(np.median(e.recent))

    def observe_verify(self, positions: int, verify_s: float) -> None:
        self._verify_obs.append((float(positions), float(verify_s)))
        obs = list(self._verify_obs)
        if not self.fit_verify_after or len(obs) < self.fit_verify_after:
            return
        # Median per batch size first: a shared CPU adds rare long stalls that a plain fit would follow.
        sizes = sorted({o[0] for o in obs})
        x = np.array(sizes)
        y = np.array([np.median([o[1] for o in obs if o[0] == sz]) for sz in sizes])
        if x.size < 2:
            # One batch size so far: keep the slope, move the intercept to the mean.
            self.t0 = max(0.0, float(np.mean(y - self.t1 * x)))
            return
        t1, t0 = np.polyfit(x, y, 1)
        if t1 >= 0 and t0 >= 0:
            self.t0, self.t1 = float(t0), float(t1)
        else:  # a negative fit would make the model nonsense; fall back to a line through the origin
            self.t0, self.t1 = 0.0, float(max(0.0, np.sum(x * y) / np.sum(x * x)))

    def observe_round(self, measured_round_s: float, predicted_round_s: float, overhead_used_s: float) -> None:
        """Residual of the round time beyond the modeled phases; T_0 = median of the recent residuals."""
        residual = measured_round_s - (predicted_round_s - overhead_used_s)
        if not self.fit_round_overhead or not math.isfinite(residual):
            return
        self._overhead_obs.append(residual)
        recent = self._overhead_obs
        if len(recent) >= 3:
            self.round_overhead_s = max(0.0, float(np.median(recent)))

    def observe_upload(self, charged_bytes: int, planned_bits: float, header_used_bits: float) -> None:
        """Header bits = what the channel charged minus the payload the model counted; median of recent."""
        bits = 8.0 * charged_bytes - (planned_bits - header_used_bits)
        if not math.isfinite(bits):  # charged_bytes comes from a header annotation
            return
        self._header_obs.append(bits)
        recent = self._header_obs
        if len(recent) >= 3:
            self.header_bits = max(0.0, float(np.median(recent)))

    # -- planning --------------------------------------------------------------------------------
    def scenario_for(self, names: list[str], gains: dict[str, float]) -> Scenario:
        """The base scenario restricted to `names`, with the current estimates in place."""
        keep = set(names)
        data = self.base.model_dump(exclude_none=True)
        data["devices"] = [d for d in data["devices"] if d["name"] in keep]
        data["verify_t0_s"], data["verify_t1_s"] = self.t0, self.t1
        data["round_overhead_s"] = self.round_overhead_s
        data["header_bits"] = self.header_bits
        sub = Scenario.from_dict(data)
        return sub.with_device_updates(
            acceptance={n: self.est[n].alpha for n in names},
            draft_time_s={n: self.est[n].draft_time_s for n in names},
            channel_gain_db={n: gains[n] for n in names},
        )

    def plan_round(self, round_index: int, names: list[str], t_s: float = 0.0) -> RoundPlan:
        gains = self.gains_db(round_index, t_s)
        scen = self.scenario_for(names, gains)
        if self.pin_mode and self.pin_draft_len:
            # Fully pinned schedule: nothing to optimise, only the model's prediction of it.
            n = scen.num_devices
            chosen = self._pinned(scen, "pinned", [self.pin_mode] * n, [self.pin_draft_len] * n)
        else:
            chosen = plan(scen, self.policy, fixed_length=self.fixed_length, seed=self.seed + round_index)
            if self.pin_mode or self.pin_draft_len:
                chosen = self._pinned(scen, f"{chosen.policy}+pinned", chosen.modes, chosen.draft_lens)
        est = {n: {"alpha": self.est[n].alpha, "draft_time_s": self.est[n].draft_time_s, "gain_db": gains[n]}
               for n in names}
        return RoundPlan(round_index, list(names), chosen.to_dict(), scen, est,
                         {d.name: d for d in chosen.device_plans()})

    def _pinned(self, scen: Scenario, policy: str, modes, draft_lens) -> Plan:
        """The profile pins every device's mode and/or draft length (e.g. to compare UL and DL mode on the
        same schedule); the prediction is the model's evaluation of that schedule."""
        modes = [self.pin_mode or m for m in modes]
        lens = [min(self.pin_draft_len or int(n), scen.max_draft_len) for n in draft_lens]
        return Plan(policy=policy, scenario=scen, evaluation=evaluate(scen, modes, lens))


def channel_links(rp: RoundPlan, fallback_dl_bps: float = 1e9) -> dict[str, dict]:
    """Per-device rates for the channel emulator. A UL-mode device's reply is a few bytes the model charges
    as a constant; it gets a fast link (not a zero one) so the emulator still accounts it."""
    links = {}
    for name, d in rp.per_device.items():
        ul = d.ul_rate_bps or None
        dl = d.dl_rate_bps or None
        if d.mode == "UL" or not dl:
            dl = fallback_dl_bps
        links[name] = {"ul_rate_bps": ul, "dl_rate_bps": dl}
    return links


def round_record(rp: RoundPlan, *, policy: str, outcomes: dict[str, DeviceOutcome], verify_s: float | None,
                 round_s: float, t_start_s: float, extra: dict | None = None) -> dict:
    """Assemble one round record: per device and per phase, predicted next to measured.

    `outcomes[name]` is what the edge saw of a device; the plan's devices absent from it missed the round (no
    draft by the deadline, a refused draft, or the device left during the round).
    Tokens count only when the device's report confirmed that its verdict arrived (`report_late`: 0).
    Every number in the record is finite (a non-finite one becomes null): the recorder writes strict JSON.
    """
    devices = {name: _device_entry(rp, name, outcomes.get(name), round_s) for name in rp.devices}
    present = [name for name in rp.devices if name in outcomes]
    up_phases = [devices[n]["measured"]["up_phase_s"] for n in present]
    # The DL phase is the shared DL of the distributions p_j; a verdict that carries a token is a short reply.
    dl_phases = [devices[n]["measured"]["downlink_s"] for n in present
                 if rp.per_device[n].mode == "DL" and outcomes[n].dl_payload == "p"]
    up_phases = [t for t in up_phases if t is not None]
    dl_phases = [t for t in dl_phases if t is not None]
    tokens = sum(_credited(outcomes[n]) for n in present)
    plan = rp.plan
    phases = plan.get("phases_s", {})
    predicted = {"uplink_phase_s": phases.get("uplink"), "verify_s": phases.get("verify"),
                 "downlink_phase_s": phases.get("downlink"), "round_s": plan.get("round_time_s"),
                 "tokens": float(sum(d.expected_tokens for d in rp.per_device.values())),
                 "goodput_tps": plan.get("goodput_tps")}
    measured = {"uplink_phase_s": max(up_phases) if up_phases else None, "verify_s": verify_s,
                "downlink_phase_s": max(dl_phases) if dl_phases else 0.0, "round_s": round_s, "tokens": tokens,
                "goodput_tps": tokens / round_s if round_s > 0 else None}
    rec = {"round": rp.round, "t_start_s": t_start_s, "policy": policy,
           "num_ul": sum(1 for n in rp.devices if rp.per_device[n].mode == "UL"),
           "devices": devices, "predicted": predicted, "measured": measured,
           "verify_model": {"t0_s": rp.scenario.verify_t0_s, "t1_s": rp.scenario.verify_t1_s},
           "round_overhead_s": rp.scenario.round_overhead_s,
           "missed": [n for n in rp.devices if n not in outcomes]}
    if extra:
        rec.update(extra)
    return _finite(rec)


def _credited(o: DeviceOutcome) -> int:
    """The tokens a device's round is credited with: none unless its report confirmed the verdict arrived."""
    return 0 if o.report_late else (o.tokens or 0)


def _finite(obj):
    """`obj` with every non-finite float (NaN, +-inf) replaced by None, recursively (dicts, lists, tuples)."""
    if isinstance(obj, (float, np.floating)):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _device_entry(rp: RoundPlan, name: str, o: DeviceOutcome | None, round_s: float) -> dict:
    """One device's part of the round record: its schedule, the prediction and (unless missed) the measurement."""
    d = rp.per_device[name]
    predicted = {
        "draft_s": d.draft_s, "uplink_s": d.tx_s, "up_phase_s": d.uplink_s, "downlink_s": d.downlink_s,
        "tokens": d.expected_tokens, "goodput_tps": d.goodput_tps, "ul_bits": d.ul_bits, "dl_bits": d.dl_bits,
        "ul_rate_bps": d.ul_rate_bps, "dl_rate_bps": d.dl_rate_bps,
    }
    entry = {"mode": d.mode, "draft_len": d.draft_len, "ul_power_w": d.ul_power_w, "dl_power_w": d.dl_power_w,
             "estimate": rp.estimates.get(name), "predicted": predicted}
    if o is None:
        entry.update({"missed": True, "measured": None})
        return entry
    tm = o.timings
    measured = {
        "draft_s": tm.get("draft_s"), "compute_s": tm.get("compute_s"),
        "emulated_extra_s": tm.get("emulated_extra_s"), "compute_scale": tm.get("compute_scale"),
        "uplink_s": _air_time(o.ul_channel), "up_phase_s": o.up_phase_s, "downlink_s": _air_time(o.dl_channel),
        "tokens": _credited(o), "goodput_tps": _credited(o) / round_s if round_s > 0 else None,
        "tokens_sent": o.tokens,  # what the verdict carried, confirmed or not
        # What the channel charged when an emulator is in between; else the bytes the edge saw.
        "ul_bytes": _bytes(o.ul_channel, o.ul_bytes),
        "dl_bytes": _bytes(o.dl_channel, o.dl_bytes),
    }
    entry.update({"missed": False, "n_accepted": o.n_accepted, "dl_payload": o.dl_payload, "measured": measured,
                  "ul_channel": o.ul_channel, "dl_channel": o.dl_channel, "report_late": o.report_late,
                  "verdict_unconfirmed": o.report_late})
    return entry


def _bytes(ch: dict | None, counted: int) -> int:
    """The bytes the channel charged (its annotation), else the edge's own count of the message's frames."""
    charged = (ch or {}).get("bytes")
    return counted if charged is None else charged


def _air_time(ch: dict | None) -> float | None:
    """The realized air time of one message from the emulator's annotation.

    Real mode: held_s (from the start of the air time, i.e. the tx_start marker or the arrival, to the
    forwarding: air time + queueing + base latency + lateness). Virtual mode: what it would have taken.
    """
    if not ch:
        return None
    if ch.get("mode") == "virtual":
        return (ch.get("airtime_s") or 0.0) + (ch.get("queued_s") or 0.0) + (ch.get("base_latency_s") or 0.0)
    return ch.get("held_s")
