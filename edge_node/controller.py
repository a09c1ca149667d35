"""The per-round controller (runs in the edge process): online estimates -> plan -> predictions.

Pure logic (no sockets, no clocks): the edge server feeds it observations and asks it for a plan.
- alpha_k: Beta posterior mean; prior mean = the profile's acceptance, `alpha_prior_trials` pseudo-trials.
  A round with n accepted out of L is n successes and (1 if n < L) failure: per-token Bernoulli trials
  up to and including the first rejection. Rounds drafted from a top-k truncated q (`payload_format: topk`,
  `topk_choices`) feed a posterior per (device, k) instead, whose prior mean is the scenario's
  ratio of k calibrated before round 0 (`edge_node.topk_calibration`; else `topk_acceptance_ratio[k]`) x the
  device's dense alpha; the plan gets them per option (`core.payload`).
- t_k: median of the last `draft_time_window` device-reported drafting times per token (they include the
  emulated slowdown; a median because a shared CPU adds rare long stalls), seeded from the profile's
  draft_time_s times the device's compute_scale, or (`calibrate`) the device's own timing at registration.
- g_k: from the channel state (`testbed.channel.state.ChannelState`) per round, or the scenario's static
  gains.
- T_ver = t0 + t1 * sum(L+1): least-squares refit from the measured verification times once there are
  enough rounds with different batch sizes; until then the profile's t0, t1, or (`calibrate`) those timed on
  the target before round 0 (`edge_node.calibration`).
- H (header bits): seeded from the wire format (`seed_header_bits`), then refitted from what the channel
  charged for draft uploads, from the DL-mode uploads when there are any (see `observe_upload`).

The round record names every phase with one vocabulary (`PHASE_FIELDS`, the same names as `multispin plan
--json` and the report): draft_s, ul_air_s, uplink_phase_s, verify_s, dl_air_s, downlink_phase_s, round_s.
With a virtual channel the measured times are on a virtual clock (`virtual_round`): measured compute plus
the emulator's annotated air time, so that they compare with the model's (`time_base: "virtual"`).
"""

from __future__ import annotations

import logging
import math
import statistics
import traceback
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from edge_node import topk_estimate
from testbed.core import payload
from testbed.core.model import distribution_bits, evaluate
from testbed.core.optimizer import BuiltinPolicy, DevicePlan, InfeasiblePlanError, Plan, plan
from testbed.core.policy import DeviceResult, PolicyError, RoundOutcome, policy_name
from testbed.core.scenario import Scenario
from testbed.core.vocabulary import (
    DL,
    PHASE_FIELDS,  # noqa: F401 - re-exported
    UL,
)
from testbed.runtime.energy import EnergyLedger, add_device_energy, add_round_energy
from testbed.runtime.errors import TestbedError

log = logging.getLogger("multispin.controller")
# Where a round goes when the profile's policy finds no feasible schedule, or (with `on_plugin_error:
# fallback`) a plug-in policy raised or its decision cannot be used (`PolicyError`): DL mode uploads only token
# ids and one probability per token, the cheapest upload there is. The profile's `fallback_policy` names
# another. The round record says why (`fallback`, with its `kind`: FALLBACK_KINDS).
FALLBACK_POLICY = "all-dl"
# Why a round was not planned as the profile says (the record's `fallback.kind`; `channel_fallback` for the
# channel source), counted per kind in summary.json's `fallbacks`.
FALLBACK_KINDS = ("infeasible", "plugin_error", "policy_error", "channel_source_error")
ON_PLUGIN_ERROR = ("stop", "fallback")
# The online verification fit needs this many batch sizes spanning this factor; else only the intercept moves,
# over this many recent rounds. Two sizes 1.5x apart: on the Qwen pair (CPU) the calibrated slope was 4x too low
# for the rounds' 4-8 positions (the forward is not linear there) and the intercept alone left rounds 16% short
# at the median; replayed on 41 recorded Qwen runs, fitting from 3 rounds on two such sizes took the median
# round error from 8.7% to 5.0% and the runs above 10% from 23 to 6 (docs/models.md).
VERIFY_FIT_SIZES, VERIFY_FIT_SPAN, VERIFY_RECENT = 2, 1.5, 20


@dataclass
class DeviceEstimate:
    alpha_prior: float
    prior_trials: float
    draft_time_s: float
    successes: float = 0.0
    trials: float = 0.0
    rounds_timed: int = 0
    recent: list = field(default_factory=list)
    calibrated: bool = False  # draft_time_s is the device's own timing at registration, not the prior

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
    requested: list[str] | None = None  # the devices asked for (`devices` leaves out those that sat out)
    t_s: float = 0.0                 # the channel state's time the plan used (s since the edge started)
    # name -> {"ul": bit/s or None, "dl": bit/s or None}: rates fixed by a rate trace or by the edge's own
    # measurement of a real link (`rate_source` says which); the emulator is configured with these.
    rate_override: dict[str, dict] = field(default_factory=dict)
    rate_source: str | None = None   # "trace" or "measured"
    # A measured real link: name -> {"ul", "dl"}: "rounds" | "probe" | "model", the estimate each direction
    # was planned with (`Controller.measured_sources`).
    link_sources: dict[str, dict] = field(default_factory=dict)
    live_used: dict[str, dict] = field(default_factory=dict)  # name -> ChannelState.live_used at plan time
    sat_out: dict[str, str] = field(default_factory=dict)     # name -> why it is not in this round
    # name -> energy constants and budgets for the record (`testbed.runtime.energy.EnergyLedger.budgeted`)
    energy: dict[str, dict] = field(default_factory=dict)
    # The channel source raised and `on_plugin_error: fallback` planned with the scenario's static gains:
    # {source, error, reason, gains: "static"} (the record's `channel_fallback`).
    channel_fallback: dict | None = None
    # name -> why its gain is the mean path loss at distance_m (its channel state gave no gain, SNR or rate).
    gain_fallback: dict[str, str] = field(default_factory=dict)
    prefill_positions: int = 0  # prompt positions to prefill in this round's verification (in its t_0)
    # Which estimates are still priors and which are fits (`Controller.estimates_from`; the record's field).
    estimates_from: dict = field(default_factory=dict)

    @property
    def topk(self) -> int | None:
        """The k every device of this round drafts with (schedule.topk), None: dense (`payload.topk_of`)."""
        return payload.topk_of(self.scenario) if self.devices else None


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
    link: dict | None = None          # `channel.measure_links`: {"ul"/"dl": LinkEstimator.observe entries}
    q_bytes: int | None = None        # bytes of the uploaded distributions (dense q, or top-k ids + values)


class Controller:
    def __init__(self, scenario: Scenario, *, policy="proposed", fixed_length: int = 4, seed: int = 0,
                 channel_state=None, compute_scale: dict[str, float] | None = None,
                 alpha_prior_trials: float = 8.0, draft_time_window: int = 10, fit_verify_after: int = 3,
                 pin_mode: str | None = None, pin_draft_len: int | None = None, fit_round_overhead: bool = True,
                 on_plugin_error: str = "stop", fallback_policy: str = FALLBACK_POLICY,
                 policy_params: dict | None = None, calibrate: bool = False):
        self.base = scenario
        # Calibration before round 0 (`calibrate_draft_time`, `calibrate_verify`): False keeps the priors.
        self.calibrate = bool(calibrate)
        # What calibration measured: {"draft_time_s": {name: s/token}, "verify": {t0, t1, shapes, took_s}}
        self.calibration: dict = {"draft_time_s": {}, "verify": None}
        self.pin_mode, self.pin_draft_len = pin_mode, pin_draft_len
        # policy: a name (built-in, module:Class, an entry point; testbed.runtime.plugins) or a Policy object;
        # `policy_params`: a plug-in's parameters (the profile's policy_params[policy])
        from testbed.runtime.plugins import load_policy

        self.policy_impl = load_policy(policy, policy_params) if isinstance(policy, str) else policy
        self.policy = policy if isinstance(policy, str) else policy_name(policy)
        if on_plugin_error not in ON_PLUGIN_ERROR:
            raise TestbedError(f"on_plugin_error: {on_plugin_error!r} is not allowed: {' or '.join(ON_PLUGIN_ERROR)}")
        # A plug-in that raises: stop the run (PluginFailure), or plan that round without it ("fallback").
        self.on_plugin_error, self.fallback_policy = on_plugin_error, fallback_policy
        self.fixed_length, self.seed = fixed_length, seed
        self.previous: RoundOutcome | None = None  # the latest closed round, for the policy (`observe_outcome`)
        self.channel_state = channel_state
        self.window = max(1, int(draft_time_window))
        self.fit_verify_after = fit_verify_after
        scale = compute_scale or {}
        self.est: dict[str, DeviceEstimate] = {
            d.name: DeviceEstimate(d.acceptance, alpha_prior_trials, d.draft_time_s * scale.get(d.name, 1.0))
            for d in scenario.devices
        }
        self.static_gains = dict(zip([d.name for d in scenario.devices], scenario.gains_db().tolist()))
        self.prior_trials = float(alpha_prior_trials)
        self.topk_trials: dict[tuple[str, int], list[float]] = {}  # (name, k) -> [successes, trials]
        self.topk_ratio: dict[int, float] = {}  # k -> alpha_k / alpha measured before round 0 (`calibrate_topk`)
        self.t0, self.t1 = scenario.verify_t0_s, scenario.verify_t1_s
        self.verify_from = "prior"  # | "calibrated" (`calibrate_verify`) | "intercept" | "fit" | "origin"
        # Positions the next round's verification computes beyond sum(L_k + 1): prompts of sessions not yet
        # prefilled (set by the edge before it plans; `plan_verify_t0`).
        self.prefill_positions = 0
        # Observation windows are bounded: an edge runs for days, and only the recent ones are used.
        self._verify_obs: deque[tuple[float, float]] = deque(maxlen=200)
        # T_0 (spec section 4): the round's fixed overhead (messages, scheduling) the model does not see.
        self.fit_round_overhead = fit_round_overhead
        self.round_overhead_s = scenario.round_overhead_s
        self._overhead_obs: deque[float] = deque(maxlen=20)
        # Protocol header bits per message: measured from what the channel charged for draft uploads.
        self.header_bits = scenario.header_bits
        self.header_from = "scenario" if scenario.header_bits else "none"  # | "wire_prior" | "fit_dl" | "fit_all"
        self._header_obs: deque[float] = deque(maxlen=50)
        self._header_obs_dl: deque[float] = deque(maxlen=50)  # DL-mode uploads only (see observe_upload)
        # Rates the edge measured on a real link (`channel.measure_links`): name -> {"ul": bit/s or None,
        # "dl": bit/s or None}; they fix those links' rates in the plan as a rate trace does.
        self.measured_rates: dict[str, dict[str, float | None]] = {}
        # ... and which estimate each is: name -> {"ul", "dl"}: "rounds" | "probe" | "model" (none: the model's
        # rate); `testbed.runtime.link_estimate.LinkEstimator.choose`.
        self.measured_sources: dict[str, dict[str, str]] = {}
        # Energy constants per device (from its registration) and the UL air-time excess the budgets allow for.
        self.energy = EnergyLedger(scenario)

    # -- estimates -------------------------------------------------------------------------------
    def gains_db(self, round_index: int, t_s: float) -> dict[str, float]:
        if self.channel_state is None:
            return dict(self.static_gains)
        return self.channel_state.gains_db(round_index, t_s)

    def _round_gains(self, round_index: int, t_s: float) -> tuple[dict[str, float], dict | None]:
        """(gains, channel fallback): a plug-in channel source that raises (or answers unusably) stops the
        run (`PluginFailure`), or with `on_plugin_error: fallback` this round is planned on the scenario's
        static gains and the second item says why."""
        cs = self.channel_state
        if cs is None or _builtin_source(cs):
            return self.gains_db(round_index, t_s), None
        try:
            return self.gains_db(round_index, t_s), None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            from testbed.runtime.plugins import PluginFailure

            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            if self.on_plugin_error == "stop":
                log.error("round %d: channel source %r raised; stopping the run\n%s", round_index, cs.source, tb)
                raise PluginFailure("channel source", cs.source, round_index, error, tb) from exc
            log.warning("round %d: channel source %r: %s; planning this round on the scenario's static gains "
                        "(on_plugin_error: fallback)\n%s", round_index, cs.source, error, tb)
            return dict(self.static_gains), {"kind": "channel_source_error", "source": cs.source,
                                             "error": type(exc).__name__, "reason": str(exc), "gains": "static"}

    def observe_acceptance(self, name: str, n_accepted: int, draft_len: int, topk: int | None = None) -> None:
        """A round's accepted count; `topk`: the round drafted from the top-k truncated q (its own alpha)."""
        trials = n_accepted + (1 if n_accepted < draft_len else 0)
        if topk is not None:
            counts = self.topk_trials.setdefault((name, int(topk)), [0.0, 0.0])
            counts[0] += n_accepted
            counts[1] += trials
            return
        e = self.est[name]
        e.successes += n_accepted
        e.trials += trials

    def _ratio(self, k: int) -> float:  # r_k: calibrated, else the scenario's
        return self.topk_ratio.get(int(k)) or payload.ratio(self.base, k)

    def alpha_dense(self, name: str, skip: int | None = None) -> float:
        """The device's dense alpha from its rounds of every option but `skip` (`edge_node.topk_estimate`)."""
        return topk_estimate.dense_alpha(self.est[name], self.topk_trials, name, self._ratio, skip)

    def alpha_topk(self, name: str, k: int) -> float:
        """alpha of a device drafting from its top-k truncated q: Beta posterior of its k rounds around r_k x
        the dense alpha its other rounds tell (`edge_node.topk_estimate`)."""
        return topk_estimate.alpha_under(int(k), self.alpha_dense(name, skip=int(k)), self.prior_trials,
                                         self.topk_trials.get((name, int(k))), self._ratio)

    def observe_draft_time(self, name: str, draft_s: float, draft_len: int) -> None:
        if not (draft_s > 0 and draft_len > 0 and math.isfinite(draft_s)):  # a device's own report
            return
        e = self.est[name]
        e.rounds_timed += 1
        if e.rounds_timed == 1:
            return  # the first draft also prefills the prompt and warms the runtime up: not a per-token time
        e.recent = (e.recent + [draft_s / draft_len])[-self.window:]
        e.draft_time_s = statistics.median(e.recent)  # np.median's value, at a tenth of its cost per round

    def calibrate_draft_time(self, name: str, draft_time_s: float | None) -> bool:
        """A device's own timing of its drafting (s/token, its slowdown included; `register.draft_time_s`):
        its t_k until its rounds give a median (its first round, the prefill, is not one). Ignored without
        `calibrate`, and once its rounds were timed. Returns whether it was taken."""
        if (not self.calibrate or name not in self.est or draft_time_s is None
                or not (math.isfinite(draft_time_s) and draft_time_s > 0)):
            return False
        self.calibration["draft_time_s"][name] = float(draft_time_s)
        e = self.est[name]
        if e.rounds_timed > 1:
            return False
        e.draft_time_s, e.calibrated = float(draft_time_s), True
        return True

    def calibrate_topk(self, result: dict | None) -> bool:
        """r_k = alpha_k / alpha measured on the pair before round 0 (`edge_node.topk_calibration`), in place
        of the scenario's ratios. Ignored without `calibrate`."""
        if not self.calibrate or not result:
            return False
        self.calibration["topk"] = result
        self.topk_ratio.update({int(k): float(r) for k, r in result["ratio"].items()})
        return True

    def calibrate_verify(self, result: dict | None) -> bool:
        """t_0, t_1 timed on the target before round 0 (`edge_node.calibration.calibrate_verification`): the
        verification model until the online fit (`observe_verify`) replaces it. Ignored without `calibrate`."""
        if not self.calibrate or not result:
            return False
        self.calibration["verify"] = result
        self.t0, self.t1 = float(result["verify_t0_s"]), float(result["verify_t1_s"])
        self.verify_from = "calibrated"
        return True

    def observe_verify(self, positions: int, verify_s: float, prefill_positions: int = 0) -> None:
        """One round's verification of `positions` drafted positions. A round that also prefilled prompts is
        left out: no steady-state round (Qwen, CPU: 6 drafts + 13 prompt positions verified in 1.29 s, 9 drafts
        in 1.56 s), it pulled the fitted slope down for every later round."""
        if prefill_positions:
            return
        self._verify_obs.append((float(positions), float(verify_s)))
        obs = list(self._verify_obs)
        if not self.fit_verify_after or len(obs) < self.fit_verify_after:
            return
        # Median per batch size first: a shared CPU adds rare long stalls that a plain fit would follow.
        sizes = sorted({o[0] for o in obs})
        x = np.array(sizes)
        y = np.array([np.median([o[1] for o in obs if o[0] == sz]) for sz in sizes])
        if x.size >= VERIFY_FIT_SIZES and x[-1] >= VERIFY_FIT_SPAN * x[0]:
            t1, t0 = np.polyfit(x, y, 1)
            if t1 >= 0 and t0 >= 0:
                self.t0, self.t1 = float(t0), float(t1)
                self.verify_from = "fit"
                return
        # Batch sizes too close together to tell a slope from noise (the Qwen pair's rounds, 4 to 6 positions,
        # fitted t1 = 1.13 s and t0 = 0): keep the slope (calibrated or prior) and move the intercept to the
        # median residual of the recent rounds, which also follows a host whose load changes. A target faster
        # than the slope allows (the intercept would go below 0) gets a line through the origin instead.
        recent = obs[-VERIFY_RECENT:]
        t0 = float(np.median([v - self.t1 * n for n, v in recent]))
        if t0 >= 0:
            self.t0, self.verify_from = t0, "intercept"
        else:
            self.t0, self.t1, self.verify_from = 0.0, float(np.median([v / n for n, v in recent])), "origin"

    def observe_round(self, measured_round_s: float, predicted_round_s: float, overhead_used_s: float,
                      verify_error_s: float = 0.0) -> None:
        """Residual of the round time beyond the modeled phases; T_0 = median of the recent residuals.
        `verify_error_s` (measured - predicted verification) is left out: the verification model fits itself
        (`observe_verify`), and the first rounds' prior would otherwise sit in T_0 for a whole window."""
        residual = measured_round_s - (predicted_round_s - overhead_used_s) - verify_error_s
        if not self.fit_round_overhead or not math.isfinite(residual):
            return
        self._overhead_obs.append(residual)
        recent = self._overhead_obs
        if len(recent) >= 3:
            self.round_overhead_s = max(0.0, statistics.median(recent))

    def observe_hardware(self, name: str, hardware: dict | None) -> None:
        """The hardware a device registered with: its energy constants (receive power, J per drafted token)."""
        self.energy.set_hardware(name, hardware)

    def observe_outcome(self, record: dict) -> None:
        """A finished round's record: what the policy sees of it in its next plan (`RoundContext.previous`)."""
        self.previous = outcome_of(record)

    def observe_energy(self, record: dict) -> None:
        """A finished round's record: the measured UL air times, which set the energy budgets' margins."""
        self.energy.observe(record)

    def seed_header_bits(self, bits: float) -> None:
        """A prior for H from the wire format (the edge encodes a typical draft): without it the first rounds,
        planned before any upload was charged, count no header at all, and a DL-mode upload (about 400 bytes,
        most of it header) is predicted at a tenth of its air time. A scenario's own H, or a fit, wins."""
        if self.base.header_bits == 0 and not self._header_obs and math.isfinite(bits) and bits > 0:
            self.header_bits = float(bits)
            self.header_from = "wire_prior"

    def observe_upload(self, charged_bytes: int, planned_bits: float, header_used_bits: float,
                       mode: str | None = None) -> None:
        """Header bits = what the channel charged minus the payload the model counted; median of recent.

        One H serves both modes, and it matters only where the payload is small: a DL-mode upload is a few
        hundred bytes (its wire format, int32 ids and float64 q_at, is also wider than the model's b_id and
        b_p), a UL-mode upload megabytes. So H is the median over the DL-mode uploads once there are 3 of
        them; the error this leaves on a UL-mode upload is below 1e-3 of its air time."""
        bits = 8.0 * charged_bytes - (planned_bits - header_used_bits)
        if not math.isfinite(bits):  # charged_bytes comes from a header annotation
            return
        self._header_obs.append(bits)
        if mode == DL:
            self._header_obs_dl.append(bits)
        recent = self._header_obs_dl if len(self._header_obs_dl) >= 3 else self._header_obs
        if len(recent) >= 3:
            # statistics.median: the same number as numpy's, at a thirtieth of its cost on 50 values (per draft)
            self.header_bits = max(0.0, float(statistics.median(recent)))
            self.header_from = "fit_dl" if recent is self._header_obs_dl else "fit_all"

    def estimates_from(self, names: list[str]) -> dict:
        """Which estimates a plan uses are priors (the profile's) and which are fitted from the run: the
        record's `estimates_from` (docs/extending.md, "Every fallback")."""
        fitted_overhead = self.fit_round_overhead and len(self._overhead_obs) >= 3
        untimed = [n for n in names if self.est[n].rounds_timed <= 1]
        return {"verify_model": self.verify_from, "header_bits": self.header_from,
                "round_overhead": "fit" if fitted_overhead else "prior",
                "alpha_prior": [n for n in names if self.est[n].trials <= 0],
                "draft_time_prior": [n for n in untimed if not self.est[n].calibrated],
                "draft_time_calibrated": [n for n in untimed if self.est[n].calibrated]}

    # -- planning --------------------------------------------------------------------------------
    def plan_verify_t0(self) -> float:
        """t_0 of the round being planned: the model's, plus the prefill of prompts that join this round (a
        constant of the round, so it moves no choice of L; without it the Qwen pair's round 0 read 150% over)."""
        return self.t0 + self.t1 * self.prefill_positions

    def scenario_for(self, names: list[str], gains: dict[str, float],
                     rate_override: dict[str, dict] | None = None) -> Scenario:
        """The base scenario restricted to `names`, with the current estimates in place; a device whose rate
        is fixed (`rate_override`: name -> {"ul", "dl"} bit/s or None) gets it as the core model's fixed rate
        of that direction (the model's other direction keeps its gain)."""
        keep = set(names)
        sub = self.base.with_device_updates(
            acceptance={n: self.est[n].alpha for n in names},
            draft_time_s={n: self.est[n].draft_time_s for n in names},
            channel_gain_db={n: gains[n] for n in names}, only=keep,
            fields={"verify_t0_s": self.plan_verify_t0(), "verify_t1_s": self.t1,
                    "round_overhead_s": self.round_overhead_s,
                    "header_bits": self.header_bits},
        )
        if not rate_override:
            return sub
        return sub.with_device_updates({n: {"fixed_ul_rate_bps": r.get("ul") or None,
                                            "fixed_dl_rate_bps": r.get("dl") or None}
                                        for n, r in rate_override.items() if n in keep})

    def rate_overrides(self, round_index: int, t_s: float, names: list[str],
                       channel_ok: bool = True) -> tuple[dict[str, dict], str | None]:
        """(name -> {"ul", "dl"} fixed rates in bit/s, where they come from): a rate trace of the channel
        state (``trace``), else the rates the edge measured on a real link (``measured``); ({}, None) if none.
        `channel_ok` False: the channel source failed this round (its rates are not asked for)."""
        cs = self.channel_state
        # a rate trace, or a plug-in source's rates
        if channel_ok and cs is not None and hasattr(cs, "rate_override_bps"):
            ov = cs.rate_override_bps(round_index, t_s)
            fixed = {n: dict(ov[n]) for n in names if n in ov and (ov[n]["ul"] or ov[n]["dl"])}
            if fixed:
                return fixed, "trace"
        fixed = {n: dict(self.measured_rates[n]) for n in names
                 if n in self.measured_rates and any(self.measured_rates[n].values())}
        return (fixed, "measured") if fixed else ({}, None)

    def plan_round(self, round_index: int, names: list[str], t_s: float = 0.0) -> RoundPlan:
        asked = list(names)
        gains, channel_fb = self._round_gains(round_index, t_s)
        cs = self.channel_state
        live = ({n: cs.live_used(n) for n in names if cs.live_used(n) is not None}
                if cs is not None and getattr(cs, "source", None) == "live" else {})
        # A live channel with `fallback: drop` leaves a device without a fresh reading out of the gains: it
        # sits this round out (no gain to plan with) instead of failing the plan.
        sat_out = {n: "no fresh link reading (channel.state.live.fallback: drop)" for n in names if n not in gains}
        usable = [n for n in names if n in gains]
        if not usable:
            return RoundPlan(round_index, [], {}, self.base, {}, requested=asked, t_s=t_s, live_used=live,
                             sat_out=sat_out, channel_fallback=channel_fb)
        fixed, source = self.rate_overrides(round_index, t_s, usable, channel_ok=channel_fb is None)
        scen = self.scenario_for(usable, gains, fixed)
        scen, energy = self.energy.budgeted(scen)  # budgets less the measured air-time margin
        names = usable
        # alpha per option, with top-k options (a dense run: none, its alpha is in the scenario)
        opts = payload.options(scen) if any(k is not None for k in payload.options(scen)) else []
        by_option = {k: {n: self.alpha_dense(n) if k is None else self.alpha_topk(n, k) for n in names} for k in opts}
        if self.pin_mode and self.pin_draft_len:
            # Fully pinned schedule: nothing to optimise but the upload format, only the model's prediction of it.
            n = scen.num_devices
            chosen = payload.best_plan(
                scen, lambda s: self._pinned(s, "pinned", [self.pin_mode] * n, [self.pin_draft_len] * n), by_option)
        else:
            chosen = self._plan_or_fall_back(scen, round_index, by_option)
            if self.pin_mode or self.pin_draft_len:
                chosen = self._pinned(chosen.scenario, f"{chosen.policy}+pinned", chosen.modes, chosen.draft_lens,
                                      chosen.info.get("payload"))
        used_gain = dict(zip([d.name for d in scen.devices], scen.gains_db().tolist()))
        est = {n: {"alpha": self.est[n].alpha, "draft_time_s": self.est[n].draft_time_s, "gain_db": used_gain[n]}
               for n in names}
        for n in names:
            if by_option:
                est[n]["alpha_topk"] = {str(k): a[n] for k, a in by_option.items() if k is not None}
        return RoundPlan(round_index, list(names), chosen.to_dict(), chosen.scenario, est,
                         {d.name: d for d in chosen.device_plans()}, requested=asked,
                         t_s=t_s, rate_override=fixed, rate_source=source, live_used=live, sat_out=sat_out,
                         energy=energy, link_sources={n: dict(self.measured_sources[n]) for n in names
                                                      if n in self.measured_sources},
                         prefill_positions=self.prefill_positions,
                         channel_fallback=channel_fb, gain_fallback=self._gain_fallback(round_index, t_s, names,
                                                                                        channel_fb),
                         estimates_from=self.estimates_from(names))

    def _gain_fallback(self, round_index: int, t_s: float, names: list[str], channel_fb: dict | None) -> dict:
        """name -> why the mean path loss stood in for its gain: its channel state (not the live source, whose
        `live_used` says it) gave it neither a gain, an SNR nor a UL rate this round."""
        cs = self.channel_state
        if cs is None or channel_fb is not None or getattr(cs, "source", None) == "live":
            return {}
        states = cs.link_states(round_index, t_s)  # cached: the states the gains came from
        return {n: "no gain, SNR or UL rate from the channel source: the mean path loss at distance_m"
                for n in names if n in states and states[n].gain_db is None and states[n].snr_db is None
                and states[n].ul_rate_bps is None}

    def _plan_or_fall_back(self, scen: Scenario, round_index: int, by_option: dict | None = None) -> Plan:
        """The profile's policy. When it finds no feasible schedule (e.g. an energy budget no upload fits:
        `infeasible`) the round goes ahead with the fallback policy (`fallback_policy`, default
        `FALLBACK_POLICY`); when a plug-in raised or its decision cannot be used (`PolicyError`) the run stops
        (`PluginFailure`), or with `on_plugin_error: fallback` the round goes ahead likewise (`plugin_error`).
        The log and the plan's `fallback` entry (then the round record's) say why."""
        seed = self.seed + round_index
        try:
            return plan(scen, self.policy_impl, fixed_length=self.fixed_length, seed=seed, round_index=round_index,
                        previous=self.previous, acceptance_by_option=by_option)
        except (InfeasiblePlanError, PolicyError) as exc:
            kind = self._fallback_kind(exc, round_index)
            log.warning("round %d: %s; planning this round with %s (%s)", round_index, exc, self.fallback_policy, kind)
            try:
                chosen = plan(scen, self.fallback_policy, fixed_length=self.fixed_length, seed=seed,
                              acceptance_by_option=by_option)
            except InfeasiblePlanError as again:
                raise TestbedError(f"round {round_index}: no feasible schedule with {self.policy!r} ({exc}) "
                                   f"nor with {self.fallback_policy!r} ({again})") from None
            chosen.info["fallback"] = {"policy": self.fallback_policy, "instead_of": self.policy, "kind": kind,
                                       "error": type(exc).__name__, "reason": str(exc)}
            return chosen

    def _fallback_kind(self, exc: Exception, round_index: int) -> str:
        """`infeasible`, `plugin_error` (a plug-in's PolicyError, which stops the run unless `on_plugin_error:
        fallback`: PluginFailure) or `policy_error` (a built-in's)."""
        if isinstance(exc, InfeasiblePlanError):
            return "infeasible"
        if isinstance(self.policy_impl, BuiltinPolicy):
            return "policy_error"
        if self.on_plugin_error == "stop":
            from testbed.runtime.plugins import PluginFailure

            cause = exc.__cause__ or exc
            tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            log.error("round %d: policy %r failed; stopping the run\n%s", round_index, self.policy, tb)
            error = f"{type(cause).__name__}: {cause}" if cause is not exc else str(exc).removeprefix(
                f"policy {self.policy}: ")
            raise PluginFailure("policy", self.policy, round_index, error, tb) from exc
        return "plugin_error"

    def _pinned(self, scen: Scenario, policy: str, modes, draft_lens, payload_info: dict | None = None) -> Plan:
        """The profile pins every device's mode and/or draft length (e.g. to compare UL and DL mode on the
        same schedule); the prediction is the model's evaluation of that schedule."""
        modes = [self.pin_mode or m for m in modes]
        lens = [min(self.pin_draft_len or int(n), scen.max_draft_len) for n in draft_lens]
        info = {"payload": payload_info} if payload_info else {}
        return Plan(policy=policy, scenario=scen, evaluation=evaluate(scen, modes, lens), info=info)


# Bounds of a gain the scenario accepts (it refuses 0 dB and above, and -250 dB and below).
def channel_links(rp: RoundPlan, fallback_dl_bps: float = 1e9) -> dict[str, dict]:
    """Per-device rates for the channel emulator. A UL-mode device's reply is a few bytes the model charges
    as a constant; it gets a fast link (not a zero one) so the emulator still accounts it. A rate trace
    (`rp.rate_source == "trace"`) replaces the planned rate of each link it fixes, in either mode: the trace
    is the link, whatever the plan would have sent over it."""
    links = {}
    for name, d in rp.per_device.items():
        ul = d.ul_rate_bps or None
        dl = d.dl_rate_bps or None
        if d.mode == UL or not dl:
            dl = fallback_dl_bps
        if rp.rate_source == "trace":  # measured rates belong to a real link: never sent to an emulator
            fixed = rp.rate_override.get(name) or {}
            ul = fixed.get("ul") or ul
            dl = fixed.get("dl") or dl
        links[name] = {"ul_rate_bps": ul, "dl_rate_bps": dl}
    return links


# The phase vocabulary, shared by `multispin plan`, the round record, the report and the docs: name -> meaning.
# Every one is in seconds. A device's uplink phase is its drafting plus its upload's air time; the round's
# uplink (downlink) phase is the largest over its devices.

@dataclass
class Arrival:
    """One message's arrival at the edge, for the virtual clock; times in s since the schedules went out."""

    at_s: float          # when the edge handled it: late by as long as the edge was busy with other work
    # at_s is only an upper bound: it was already queued when the edge became free, or its device shares a
    # busy host (`virtual_clock.VirtualClock.arrival`)
    waited: bool
    earliest_s: float    # the estimate to use then (the device's drafting time + the measured transport)
    air_s: float         # the air time (queueing and base latency included) the emulator annotated
    # What a device sharing its process with others (`devices_per_process`) measured of its wait for them,
    # between reading the message and sending its reply: a device of its own would have sent that much earlier.
    host_wait_s: float = 0.0
    handled_s: float = 0.0  # how long the edge took to handle it (decode, checks): the edge's own work

    def sent_at_s(self) -> float:
        """When it would have reached the edge with no air time and a host of its own: its handling instant
        less the shared host's wait, or the estimate when the edge was busy (then its stamp is only an upper
        bound)."""
        at = self.at_s - self.host_wait_s
        return min(at, self.earliest_s) if self.waited else at


def virtual_round(drafts: dict[str, Arrival], reports: dict[str, Arrival], *, drafts_from_s: float,
                  drafts_closed_s: float, reports_from_s: float | None, end_s: float, all_drafts: bool,
                  all_reports: bool) -> dict:
    """The round on a virtual clock: what the edge clock would have read had every charged message been held
    for its annotated air time (virtual channel mode, where the emulator forwards at once).

    Compute stays measured (drafting, verification, the edge's own work); each air time is inserted where the
    message was, and a shared host's waits are taken out (`Arrival.sent_at_s`). The edge handles the drafts
    one at a time in the order they arrive on this clock, each for as long as it took on the edge clock
    (`handled_s`): drafts that come closer together than on the edge clock queue for it. The rest of the round
    shifts by the change in the drafting phase's end; a report comes DL air later than it did. Returns the
    per-device uplink phases, the round's uplink phase and the round time (s since the schedules went out)."""
    up = {n: max(drafts_from_s, a.sent_at_s() + a.air_s) for n, a in drafts.items()}
    if not up:
        closed = drafts_closed_s
    elif all_drafts:  # closed when the last draft was handled, plus what the edge did after that
        free = drafts_from_s
        for n in sorted(up, key=up.get):
            free = max(free, up[n]) + drafts[n].handled_s
        closed = free + max(0.0, drafts_closed_s - max(a.at_s + a.handled_s for a in drafts.values()))
    else:  # the round waited for a missing draft until the (wall-clock) deadline
        closed = max(drafts_closed_s, max(up.values()))
    shift = closed - drafts_closed_s
    if not reports or reports_from_s is None:
        end = end_s + shift
    else:
        last = max(a.sent_at_s() + a.air_s for a in reports.values())
        tail = max(0.0, end_s - max(a.at_s for a in reports.values()))
        end = shift + max(reports_from_s, last) + tail
        if not all_reports:  # a late report: the round waited until the deadline
            end = max(end, end_s + shift)
    return {"up_phase_s": up, "uplink_phase_s": max(up.values()) if up else None, "round_s": end}


def round_record(rp: RoundPlan, *, policy: str, outcomes: dict[str, DeviceOutcome], verify_s: float | None,
                 round_s: float, t_start_s: float, extra: dict | None = None, virtual: dict | None = None) -> dict:
    """Assemble one round record: per device and per phase, predicted next to measured.

    `outcomes[name]` is what the edge saw of a device; the plan's devices absent from it missed the round (no
    draft by the deadline, a refused draft, or the device left during the round).
    Tokens count only when the device's report confirmed that its verdict arrived (`report_late`: 0).
    `round_s` is the edge clock's; with `virtual` (`virtual_round` of a virtual-channel round) the measured
    uplink phases, the round time and the goodput are the virtual ones (`time_base: "virtual"`) and the edge
    clock's round time stays as `measured.wall_round_s`.
    Every number in the record is finite (a non-finite one becomes null): the recorder writes strict JSON.
    """
    wall_round_s = round_s
    if virtual is not None:
        round_s = virtual["round_s"]
    devices = {name: _device_entry(rp, name, outcomes.get(name), round_s,
                                   None if virtual is None else virtual["up_phase_s"].get(name))
               for name in rp.devices}
    present = [name for name in rp.devices if name in outcomes]
    up_phases = [devices[n]["measured"]["uplink_phase_s"] for n in present]
    # The DL phase is the shared DL of the distributions p_j; a verdict that carries a token is a short reply.
    dl_phases = [devices[n]["measured"]["dl_air_s"] for n in present
                 if rp.per_device[n].mode == DL and outcomes[n].dl_payload == "p"]
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
                "goodput_tps": tokens / round_s if round_s > 0 else None, "wall_round_s": wall_round_s}
    rec = {"round": rp.round, "t_start_s": t_start_s, "policy": policy,
           "time_base": "wall" if virtual is None else "virtual",
           "num_ul": sum(1 for n in rp.devices if rp.per_device[n].mode == UL),
           "devices": devices, "predicted": predicted, "measured": measured,
           # t0_s: the model's; the prediction's t_0 adds t1_s x prefill_positions (`Controller.plan_verify_t0`)
           "verify_model": {"t0_s": rp.scenario.verify_t0_s - rp.scenario.verify_t1_s * rp.prefill_positions,
                            "t1_s": rp.scenario.verify_t1_s, "prefill_positions": rp.prefill_positions},
           "round_overhead_s": rp.scenario.round_overhead_s, "header_bits": rp.scenario.header_bits,
           "dl_provisioning": rp.scenario.dl_provisioning,
           # The round's draft distribution: dense, or top-k k (every device; docs/system-model.md, section 3).
           "payload": {"format": "dense" if rp.topk is None else "topk", "k": rp.topk,
                       "options": (plan.get("payload") or {}).get("options")},
           "missed": [n for n in rp.devices if n not in outcomes], "channel_t_s": rp.t_s}
    add_round_energy(rec)
    if plan.get("fallback"):  # the policy's plan was refused; the fallback policy planned this round
        rec["fallback"] = plan["fallback"]
    if rp.channel_fallback:  # the channel source raised; the scenario's static gains planned this round
        rec["channel_fallback"] = rp.channel_fallback
    if rp.estimates_from:
        rec["estimates_from"] = rp.estimates_from
    if rp.sat_out:  # left out of the plan (live channel, `fallback: drop`): what the channel state had
        rec["sat_out"] = {n: {"reason": why, "live_used": rp.live_used.get(n)} for n, why in rp.sat_out.items()}
    if extra:
        rec.update(extra)
    return _finite(rec)


def _builtin_source(cs) -> bool:
    """Whether a channel state's source is built in (model, trace, live): its errors are its own messages."""
    from testbed.channel.state import SOURCES

    return getattr(cs, "source", None) in SOURCES


def outcome_of(record: dict) -> RoundOutcome:
    """What a policy sees of a closed round (`testbed.core.policy.RoundOutcome`), from its record."""
    devices = {}
    for name, d in (record.get("devices") or {}).items():
        missed = bool(d.get("missed"))
        devices[name] = DeviceResult(mode=d.get("mode"), draft_len=d.get("draft_len"),
                                     n_accepted=None if missed else d.get("n_accepted"),
                                     tokens=None if missed else (d.get("measured") or {}).get("tokens"))
    measured, predicted = record.get("measured") or {}, record.get("predicted") or {}
    return RoundOutcome(round=record.get("round"), devices=devices, measured_round_s=measured.get("round_s"),
                        measured_goodput_tps=measured.get("goodput_tps"),
                        predicted_goodput_tps=predicted.get("goodput_tps"),
                        fallback=(record.get("fallback") or {}).get("reason"))


def _credited(o: DeviceOutcome) -> int:
    """The tokens a device's round is credited with: none unless its report confirmed the verdict arrived."""
    return 0 if o.report_late else (o.tokens or 0)


_PLAIN = (str, int, bool, type(None))  # what _finite passes as it is, without a call per value


def _finite(obj):
    """`obj` with every non-finite float (NaN, +-inf) replaced by None, recursively (dicts, lists, tuples)."""
    if isinstance(obj, (float, np.floating)):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):  # a round record: hundreds of values, most of them plain floats
        return {k: (v if math.isfinite(v) else None) if type(v) is float else v if type(v) in _PLAIN
                else _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _planned_entry(rp: RoundPlan, name: str) -> dict:
    """A device's schedule and prediction in the round record, with the rates and sources its plan used."""
    d = rp.per_device[name]
    predicted = {
        "draft_s": d.draft_s, "ul_air_s": d.tx_s, "uplink_phase_s": d.uplink_s, "dl_air_s": d.downlink_s,
        "tokens": d.expected_tokens, "goodput_tps": d.goodput_tps, "ul_bits": d.ul_bits, "dl_bits": d.dl_bits,
        "ul_rate_bps": d.ul_rate_bps, "dl_rate_bps": d.dl_rate_bps,
    }
    # The uploaded distributions' bytes by the model: L D / 8 in UL mode (D: V b_p dense, k (b_id + b_p) top-k).
    predicted["q_bytes"] = d.draft_len * distribution_bits(rp.scenario) / 8.0 if d.mode == UL else 0.0
    entry = {"mode": d.mode, "draft_len": d.draft_len, "ul_power_w": d.ul_power_w, "dl_power_w": d.dl_power_w,
             "topk_k": rp.topk, "estimate": rp.estimates.get(name), "predicted": predicted}
    fixed = rp.rate_override.get(name)
    if fixed is not None:  # the rates that fixed this device's links, beside the planned and charged ones
        entry["trace_rate_bps" if rp.rate_source == "trace" else "link_rate_bps"] = {
            "ul": fixed.get("ul"), "dl": fixed.get("dl")}
    if name in rp.link_sources and rp.rate_source != "trace":
        entry["link_rate_source"] = rp.link_sources[name]  # which estimate of the real link each direction used
    if name in rp.live_used:
        entry["live_used"] = rp.live_used[name]
    if name in rp.gain_fallback:
        entry["gain_fallback"] = rp.gain_fallback[name]
    return entry


def _device_entry(rp: RoundPlan, name: str, o: DeviceOutcome | None, round_s: float,
                  virtual_up_phase_s: float | None = None) -> dict:
    """One device's part of the round record: its schedule, the prediction and (unless missed) the measurement.
    Phase times carry the vocabulary's names (`PHASE_FIELDS`) only; readers accept the old names of earlier
    releases (`LEGACY_DEVICE_FIELDS`)."""
    d, entry = rp.per_device[name], _planned_entry(rp, name)
    if o is None:
        entry.update({"missed": True, "measured": None})
        add_device_energy(entry, rp.energy.get(name))
        return entry
    tm = o.timings
    ul_bytes = _bytes(o.ul_channel, o.ul_bytes)
    measured = {
        "draft_s": tm.get("draft_s"), "compute_s": tm.get("compute_s"),
        "emulated_extra_s": tm.get("emulated_extra_s"), "compute_scale": tm.get("compute_scale"),
        "host_wait_s": tm.get("host_wait_s"),  # a shared host process's wait before drafting (null: none)
        "ul_air_s": air_time(o.ul_channel),
        "uplink_phase_s": o.up_phase_s if virtual_up_phase_s is None else virtual_up_phase_s,
        "dl_air_s": air_time(o.dl_channel),
        "tokens": _credited(o), "goodput_tps": _credited(o) / round_s if round_s > 0 else None,
        "tokens_sent": o.tokens,  # what the verdict carried, confirmed or not
        # What the channel charged when an emulator is in between; else the bytes the edge saw.
        "ul_bytes": ul_bytes,
        "q_bytes": o.q_bytes,  # of them, the uploaded distributions' (dense q, or top-k ids + values)
        "dl_bytes": _bytes(o.dl_channel, o.dl_bytes),
        # Bits on the wire the model did not count (it counts ul_bits, H included): its own term, not folded
        # into the air time comparison, so that a report can show it (null without an emulator's count).
        "ul_unmodeled_bits": 8.0 * ul_bytes - d.ul_bits if o.ul_channel and d.ul_bits else None,
        "ul_air_excess_s": air_excess(o.ul_channel),
        # The rates the emulator charged (its annotation; null without an emulator).
        "ul_rate_bps": (o.ul_channel or {}).get("rate_bps"), "dl_rate_bps": (o.dl_channel or {}).get("rate_bps"),
    }
    if virtual_up_phase_s is not None:
        measured["wall_uplink_phase_s"] = o.up_phase_s  # the edge clock's, without the virtual air time
    if o.link:
        # A real link measured by the edge (`channel.measure_links`): the transfer times by the fitted line
        # (the measured time minus the fit's intercept) stand where an emulator's air times would.
        measured["link"] = o.link
        for key, direction in (("ul_air_s", "ul"), ("dl_air_s", "dl")):
            if measured[key] is None and (o.link.get(direction) or {}).get("s") is not None:
                measured[key] = o.link[direction]["s"]
    entry.update({"missed": False, "n_accepted": o.n_accepted, "dl_payload": o.dl_payload, "measured": measured,
                  "ul_channel": o.ul_channel, "dl_channel": o.dl_channel, "report_late": o.report_late,
                  "verdict_unconfirmed": o.report_late})
    add_device_energy(entry, rp.energy.get(name))
    return entry


def _bytes(ch: dict | None, counted: int) -> int:
    """The bytes the channel charged (its annotation), else the edge's own count of the message's frames."""
    charged = (ch or {}).get("bytes")
    return counted if charged is None else charged


def air_time(ch: dict | None) -> float | None:
    """The realized air time of one message from the emulator's annotation.

    Real mode: held_s (from the start of the air time, i.e. the tx_start marker or the arrival, to the
    forwarding: air time + queueing + base latency + lateness). Virtual mode: what it would have taken.
    """
    if not ch:
        return None
    if ch.get("mode") == "virtual":
        return (ch.get("airtime_s") or 0.0) + (ch.get("queued_s") or 0.0) + (ch.get("base_latency_s") or 0.0)
    return ch.get("held_s")


def air_excess(ch: dict | None) -> float | None:
    """The part of a real-mode hold that is not modeled air time: held_s - (airtime + queueing + base latency
    - lead). It is the emulator's lateness, and for a small message the gap between the tx_start marker and
    the payload's arrival when that exceeds the air time (the air time starts at the marker). 0 in virtual
    mode; None without an emulator."""
    if not ch or ch.get("held_s") is None:
        return None
    if ch.get("mode") == "virtual":
        return 0.0
    modeled = sum(ch.get(k) or 0.0 for k in ("airtime_s", "queued_s", "base_latency_s")) - (ch.get("lead_s") or 0.0)
    return max(0.0, ch["held_s"] - modeled)
