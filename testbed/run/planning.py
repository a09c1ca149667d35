"""The live controller's planning, offline (no model pair, no processes): the controller a run profile gets
(its policy, seeds, hardware `compute_scale`, estimator settings and channel state), its plans of rounds
0..R-1 on the channel state (`multispin plan --channel-rounds`), and a run's expected goodput over a fading
channel (`expected_goodput`, in summary.json).

The run (`testbed.run.session.make_controller`) builds its controller here, so that an offline plan starts
from exactly the priors a live run starts from."""

from __future__ import annotations

import math

from edge_node.controller import Controller, DeviceEstimate
from testbed.runtime.plugins import channel_state_from_config

# Draws of the expected goodput: a run's own rounds at least, at least this many, and no more plans of devices
# than DRAW_DEVICE_BUDGET in all (a run of 256 devices gets 32 draws, each a plan of 256 devices).
DEFAULT_DRAWS = 200
MIN_DRAWS = 16
DRAW_DEVICE_BUDGET = 8192
LEARNT_TRIALS = 1e9  # `with_estimates`: a run's learnt alpha under k outweighs any prior


def hardware_scales(profile, names: list[str] | None = None) -> dict[str, float]:
    """Device name -> its hardware profile's `compute_scale` (the drafting slowdown; 1 without a profile).
    ValueError names an unknown hardware profile."""
    from device_node.hardware import load_hardware

    names = names if names is not None else [d["name"] for d in profile.scenario["devices"]]
    return {n: load_hardware(profile.hardware.get(n)).compute_scale for n in names}


def scaled_scenario(scenario, scales: dict[str, float]):
    """The scenario with each device's prior drafting time x its `compute_scale`: the prior t_k of the live
    controller (docs/system-model.md, section 9)."""
    upd = {n: d.draft_time_s * scales[n] for d in scenario.devices
           if (n := d.name) in scales and scales[n] != 1.0}
    return scenario.with_device_updates(draft_time_s=upd) if upd else scenario


def channel_state_of(profile, scenario):
    """The profile's channel state, seeded like the run unless it seeds itself; None without one."""
    state = profile.channel.state
    if state is None:
        return None
    return channel_state_from_config({**state, "seed": state.get("seed", profile.seed)},
                                     list(profile.scenario["devices"]), scenario)


def make_controller(profile, scenario, scales: dict[str, float] | None = None, *, policy=None,
                    seed: int | None = None, fixed_length: int | None = None) -> Controller:
    """The controller of a run of `profile` (the live run's: `testbed.run.session.make_controller`);
    `policy`, `seed`, `fixed_length` replace the profile's (a command line's flags)."""
    est = profile.estimator
    return Controller(scenario, policy=policy or profile.policy,
                      fixed_length=fixed_length or profile.fixed_length,
                      seed=profile.seed if seed is None else seed, channel_state=channel_state_of(profile, scenario),
                      compute_scale=scales, alpha_prior_trials=est.alpha_prior_trials,
                      draft_time_window=est.draft_time_window, fit_verify_after=est.fit_verify_after,
                      pin_mode=profile.pin.mode, pin_draft_len=profile.pin.draft_len,
                      fit_round_overhead=est.fit_round_overhead, on_plugin_error=profile.on_plugin_error,
                      fallback_policy=profile.fallback_policy,
                      policy_params=profile.policy_params.get(policy or profile.policy),
                      calibrate=est.calibrate)


def plan_rounds(ctl: Controller, rounds: int, names: list[str]) -> list:
    """`ctl.plan_round` for rounds 0..rounds-1, the clock advancing by each planned round time (as a run's
    does, nothing measured); the RoundPlans."""
    t, out = 0.0, []
    for r in range(rounds):
        rp = ctl.plan_round(r, names, t)
        out.append(rp)
        t += rp.plan.get("round_time_s") or 0.0
    return out


def fading(profile) -> bool:
    """The profile's channel draws a new gain per device and round: `channel.state` of the model source with
    Rayleigh block fading (the model source's default)."""
    state = profile.channel.state
    return bool(state) and state.get("source", "model") == "model" and state.get("fading", "rayleigh") == "rayleigh"


def last_estimates(records: list[dict]) -> dict | None:
    """What the run's controller had learnt by its last round: per device the latest `estimate` (alpha,
    draft_time_s, alpha_topk: k -> alpha under k), and the last round's verify_model, round_overhead_s and
    header_bits; None without."""
    devices: dict[str, dict] = {}
    last = None
    for rec in records:
        for name, d in (rec.get("devices") or {}).items():
            e = d.get("estimate") or {}
            if e.get("alpha") is not None and e.get("draft_time_s") is not None:
                devices[name] = {"alpha": e["alpha"], "draft_time_s": e["draft_time_s"],
                                 "alpha_topk": dict(e.get("alpha_topk") or {})}
        last = rec
    if not devices or last is None:
        return None
    vm = last.get("verify_model") or {}
    return {"devices": devices, "t0_s": vm.get("t0_s"), "t1_s": vm.get("t1_s"),
            "round_overhead_s": last.get("round_overhead_s"), "header_bits": last.get("header_bits")}


def with_estimates(ctl: Controller, estimates: dict) -> None:
    """Put a run's learnt estimates (`last_estimates`) in the controller's place, as fixed priors."""
    for name, e in estimates["devices"].items():
        if name in ctl.est:
            ctl.est[name] = DeviceEstimate(float(e["alpha"]), ctl.prior_trials, float(e["draft_time_s"]))
            for k, a in (e.get("alpha_topk") or {}).items():  # the run's alpha under k: so many pseudo-trials
                ctl.topk_trials[(name, int(k))] = [float(a) * LEARNT_TRIALS, LEARNT_TRIALS]  # that no prior counts
    # ... and r_k as those estimates put it (their mean over the devices), so that the pooled dense alpha
    # (`Controller.alpha_dense`) stays the devices' learnt one
    ratios: dict[int, list[float]] = {}
    for e in estimates["devices"].values():
        for k, a in (e.get("alpha_topk") or {}).items():
            ratios.setdefault(int(k), []).append(float(a) / float(e["alpha"]))
    ctl.topk_ratio.update({k: sum(r) / len(r) for k, r in ratios.items()})
    for attr, key in (("t0", "t0_s"), ("t1", "t1_s"), ("round_overhead_s", "round_overhead_s"),
                      ("header_bits", "header_bits")):
        if estimates.get(key) is not None:
            setattr(ctl, attr, float(estimates[key]))


def default_draws(profile, rounds: int = 0) -> int:
    n = max(1, len(profile.scenario["devices"]))
    return max(MIN_DRAWS, min(max(DEFAULT_DRAWS, rounds), DRAW_DEVICE_BUDGET // n))


def expected_goodput(profile, records: list[dict] | None = None, draws: int | None = None,
                     vocab_size: int | None = None) -> dict | None:
    """A run's expected goodput over its fading channel: the mean of the planned goodput of rounds
    0..draws-1 of the profile's channel state (the run's own seeded draws, and more of them), each planned by
    the run's policy as the live controller plans it, with the estimates of the run's last round (priors
    without records); its standard error std / sqrt(draws). `vocab_size`: the model's (the run's meta.json
    `vocab_size`), replaced by the profile's on-air size as in the run. None unless the channel fades."""
    if not fading(profile):
        return None
    sc = profile.scenario_obj(vocab_size)
    ctl = make_controller(profile, sc, hardware_scales(profile))
    est = last_estimates(records or [])
    if est is not None:
        with_estimates(ctl, est)
    n = draws or default_draws(profile, len(records or []))
    plans = plan_rounds(ctl, n, [d.name for d in sc.devices])
    g = [rp.plan["goodput_tps"] for rp in plans if rp.devices and rp.plan.get("goodput_tps") is not None]
    if not g:
        return None
    mean = sum(g) / len(g)
    sd = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else None
    return {"tps": mean, "stderr_tps": sd / math.sqrt(len(g)) if sd is not None else None, "draws": len(g),
            "estimates": "last round" if est is not None else "prior", "policy": ctl.policy,
            "channel_seed": int(profile.channel.state.get("seed", profile.seed)),
            "fallback_draws": sum(1 for rp in plans if rp.plan.get("fallback"))}


def add_expected_goodput(summary: dict, profile, records: list[dict], draws: int | None = None,
                         vocab_size: int | None = None) -> dict:
    """`summary` with `expected_goodput_tps` and `expected_goodput` (the draws, the standard error, the
    estimates) under a fading channel; unchanged otherwise. A failure is recorded, not raised: the summary
    of a run must be written whatever its planning does offline."""
    if not summary.get("rounds") or not fading(profile):
        return summary
    try:
        exp = expected_goodput(profile, records, draws, vocab_size)
    except Exception as exc:  # noqa: BLE001 - a plug-in policy's or channel's failure offline
        summary["expected_goodput_tps"] = None
        summary["expected_goodput"] = {"error": f"{type(exc).__name__}: {exc}"}
        return summary
    if exp is not None:
        summary["expected_goodput_tps"] = exp["tps"]
        summary["expected_goodput"] = exp
    return summary


def expected_from_meta(summary: dict, meta: dict, records: list[dict]) -> dict:
    """`add_expected_goodput` for `multispin report`: the profile snapshot and the model's vocabulary from
    meta.json. A run directory without a loadable profile (an older or a foreign one) is left as it is."""
    from testbed.run.profile import ProfileError, load_profile

    snap = meta.get("profile")
    if not isinstance(snap, dict):
        return summary
    try:
        profile = load_profile(snap)
    except (ProfileError, ValueError, TypeError):
        return summary
    vocab = meta.get("vocab_size")
    return add_expected_goodput(summary, profile, records, vocab_size=vocab if isinstance(vocab, int) else None)
