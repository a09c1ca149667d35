"""A deadline the plan cannot meet is adapted, with a warning (issue 35).

`deadline_s` bounds how long a round waits for each draft (schedule sent -> draft in) and then for each report
(verdict sent -> report in). Before round 0, once the devices registered (each sent its own drafting time), the
controller plans round 0; when that plan predicts a device's uplink phase (its drafting, plus its upload's air
time where the rates have a basis) or the downlink phase longer than the deadline, no round could ever complete
on time: every device would miss every round. The run then goes on with `DEADLINE_MARGIN` x the predicted time
instead, says so in one warning line, and records both in meta.json (`deadline`). A passthrough link the edge
does not measure has no predicted air time: there only the drafting counts."""

from __future__ import annotations

import logging

log = logging.getLogger("multispin.session")

# The adapted deadline over the predicted phase: drafting times are medians, a shared host stalls now and then.
DEADLINE_MARGIN = 2.0


def predicted_need_s(rp, air_has_basis: bool) -> float | None:
    """The longest wait round plan `rp` predicts under the deadline: a device's uplink phase (its drafting
    alone without `air_has_basis`) or the downlink phase; None for a plan of no device."""
    waits = [(d.uplink_s if air_has_basis else d.draft_s) for d in rp.per_device.values()]
    if air_has_basis:
        waits += [d.downlink_s for d in rp.per_device.values()]
    waits = [w for w in waits if w is not None]
    return max(waits) if waits else None


def deadline_check(profile_s: float, rp, air_has_basis: bool) -> dict | None:
    """meta.json's `deadline` when the plan cannot meet `profile_s`: the profile's, the predicted wait, and the
    deadline the run uses (`DEADLINE_MARGIN` x the prediction); None when it can."""
    need = predicted_need_s(rp, air_has_basis)
    if need is None or need <= profile_s:
        return None
    return {"profile_s": profile_s, "predicted_s": need, "margin": DEADLINE_MARGIN,
            "deadline_s": DEADLINE_MARGIN * need, "round": rp.round, "basis": "uplink" if air_has_basis else "drafting"}


def builtin_planning(ctl) -> bool:
    """Whether controller `ctl` plans with a built-in policy and channel source only."""
    from testbed.channel.state import SOURCES
    from testbed.core.optimizer import POLICIES

    cs = ctl.channel_state
    return ctl.policy in POLICIES and (cs is None or getattr(cs, "source", None) in SOURCES)


def adapt_deadline(s) -> None:
    """Of a live session `s` (`testbed.run.session`), after registration: plan round 0 and, if its prediction
    exceeds `deadline_s`, warn, adapt the edge's deadline and record it in meta.json."""
    p, server = s.profile, s.server
    if not builtin_planning(s.controller):
        return  # a plug-in is planned by round 0 alone: its failures are reported once, there
    names = sorted(server.sessions) or list(s.names)
    try:
        rp = s.controller.plan_round(s.start_round, names, 0.0)
    except Exception:  # advisory: a plan that fails fails again, with its own report, as round 0 is planned
        log.debug("deadline check: planning round %d failed", s.start_round, exc_info=True)
        return
    air_has_basis = p.channel.mode != "passthrough" or bool(p.channel.measure_links)
    entry = deadline_check(server.config.deadline_s, rp, air_has_basis)
    if entry is None:
        return
    log.warning("deadline_s: %g s is shorter than the %s the plan of round %d predicts (%.3g s); rounds use "
                "%.3g s (%g x the prediction) instead", entry["profile_s"], "uplink phase" if air_has_basis else
                "drafting", rp.round, entry["predicted_s"], entry["deadline_s"], DEADLINE_MARGIN)
    server.config.adapt_deadline(entry["deadline_s"])
    s.recorder.update_meta(deadline=entry)
