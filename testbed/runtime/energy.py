"""Energy accounting of a live run: each device's transmit, receive and compute energy per round, predicted
next to measured, and the margin that keeps a device's measured transmit energy within its budget.

- The constants come from the hardware profile each device registered with (`receive_power_w`, W;
  `joules_per_token`, J per drafted token; see device_node/hardware.py). A device that declares neither has
  unknown receive and compute energy (null in the record), not zero.
- Transmit energy = the planned UL power x the UL air time: predicted with the modeled air time, measured
  with the record's `measured.ul_air_s` (the emulator's, or the edge's measurement of a real link).
- Budget: `energy_budget_j` of a device is the model's per-round uplink energy budget E_k (spec section 5).
  The optimizer keeps p S / r(p) <= E_k on the *modeled* air time; the measured air time can be longer
  (bits the model does not count, queueing, base latency, the emulator's lateness). `EnergyLedger` keeps the
  recent excess x_k = measured - predicted UL air time per device and plans with
  (1 - h) (E_k - P^max_k max(x_k)), which bounds the measured transmit energy by E_k as long as the excess
  does not grow past what was seen; the headroom h (1%) covers what the window has not seen yet (a refit of
  the header bits moves the prediction by ~0.1%; on a virtual channel nothing else does).

Pure formulas live in `testbed.core.energy`; this module holds state (constants, excess windows) and fills
the records.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from testbed.core import energy as formulas
from testbed.core import model, vocabulary
from testbed.core.scenario import Scenario

log = logging.getLogger("multispin.energy")

# Rounds of UL air-time excess the budget margin looks back on.
EXCESS_WINDOW = 20
# Share of the budget held back for an excess the window has not seen yet.
BUDGET_HEADROOM = 0.01
# Planning never goes below this multiple of the least energy of the smallest upload: below it no schedule
# is feasible and the round could not run at all (the record then says the budget could not be guaranteed).
LEAST_ENERGY_FACTOR = 1.01


@dataclass(frozen=True)
class EnergyConstants:
    """A device's energy constants; None: not declared (its receive / compute energy is unknown)."""

    receive_power_w: float | None = None
    joules_per_token: float | None = None

    @classmethod
    def from_hardware(cls, hardware: dict | None, where: str = "hardware") -> EnergyConstants:
        """From a hardware dict (a profile's, or a device's registration); a bad value raises a ValueError
        naming the field."""
        values = {}
        for key in formulas.HARDWARE_ENERGY_FIELDS:
            v = (hardware or {}).get(key)
            values[key] = None if v is None else formulas.check_energy_field(key, v, where)
        return cls(**values)


class EnergyLedger:
    """Per device: the energy constants (from its registration) and the recent UL air-time excess that the
    budget margin is built from. The controller owns one."""

    def __init__(self, base: Scenario, window: int = EXCESS_WINDOW):
        self.budgets = {d.name: d.energy_budget_j for d in base.devices}  # E_k as the profile gave it
        self.constants: dict[str, EnergyConstants] = {}
        self._excess: dict[str, deque] = {}
        self.window = window

    def set_hardware(self, name: str, hardware: dict | None) -> None:
        """What a device declared when it registered; a malformed energy field is logged and left unknown
        (the device validated its own profile; this is a device that did not)."""
        try:
            self.constants[name] = EnergyConstants.from_hardware(hardware, f"device {name}: hardware")
        except ValueError as exc:
            log.warning("%s; its receive and compute energy stay unknown", exc)
            self.constants[name] = EnergyConstants()

    def excess_s(self, name: str) -> float:
        """The largest recent (measured - predicted) UL air time of the device, floored at 0 (s)."""
        recent = self._excess.get(name)
        return max(0.0, max(recent)) if recent else 0.0

    def observe(self, record: dict) -> None:
        """A finished round: the UL air-time excess of every device that uploaded."""
        for name, dev in (record.get("devices") or {}).items():
            m, p = dev.get("measured") or {}, dev.get("predicted") or {}
            if dev.get("missed") or m.get("ul_air_s") is None or p.get("ul_air_s") is None:
                continue
            self._excess.setdefault(name, deque(maxlen=self.window)).append(m["ul_air_s"] - p["ul_air_s"])

    def budgeted(self, sc: Scenario) -> tuple[Scenario, dict[str, dict]]:
        """The scenario to plan with (each budgeted device's E_k lowered by its margin) and, per device, what
        its round record needs: constants, E_k and the budget planned with. A device whose budget the scenario
        no longer carries (a fixed UL rate: power control has no effect there) keeps E_k for the record only."""
        info: dict[str, dict] = {}
        updates: dict[str, dict] = {}
        gains = sc.gains_linear()
        for k, d in enumerate(sc.devices):
            c = self.constants.get(d.name, EnergyConstants())
            entry = {"receive_power_w": c.receive_power_w, "joules_per_token": c.joules_per_token,
                     "budget_j": self.budgets.get(d.name), "planned_budget_j": d.energy_budget_j,
                     "excess_air_s": None, "guaranteed": None}
            info[d.name] = entry
            if d.energy_budget_j is None:
                continue
            x = self.excess_s(d.name)
            planned = (1.0 - BUDGET_HEADROOM) * formulas.budget_with_margin(d.energy_budget_j, d.max_power_w, x)
            least = formulas.least_upload_energy_j(float(model.ul_first_bits(sc, False, 1)), gains[k],
                                                   sc.noise_psd_w_hz)
            floor = min(d.energy_budget_j, LEAST_ENERGY_FACTOR * least)
            entry["excess_air_s"], entry["guaranteed"] = x, planned >= floor
            planned = max(planned, floor)
            entry["planned_budget_j"] = planned
            if planned != d.energy_budget_j:
                updates[d.name] = {"energy_budget_j": planned}
        return (sc.with_device_updates(updates) if updates else sc), info


def add_device_energy(entry: dict, info: dict | None) -> None:
    """Energy fields of one device entry of a round record (in place): `predicted` and `measured` get tx_j,
    rx_j, compute_j and energy_j; the entry gets energy_budget_j, planned_energy_budget_j and within_budget
    (measured tx_j <= energy_budget_j; null without a budget or a measured air time)."""
    info = info or {}
    rx_w, per_token = info.get("receive_power_w"), info.get("joules_per_token")
    p = entry["predicted"]
    p.update(formulas.device_energy(ul_power_w=entry.get("ul_power_w"), ul_air_s=p.get("ul_air_s"),
                                    receive_power_w=rx_w, dl_air_s=p.get("dl_air_s"),
                                    joules_per_token=per_token, drafted_tokens=entry.get("draft_len")))
    budget = info.get("budget_j")
    entry["energy_budget_j"] = budget
    entry["planned_energy_budget_j"] = info.get("planned_budget_j")
    if info.get("guaranteed") is False:
        entry["energy_budget_guaranteed"] = False  # even the least upload exceeds the budget less its margin
    m = entry.get("measured")
    within = None
    if m is not None:
        m.update(formulas.device_energy(ul_power_w=entry.get("ul_power_w"), ul_air_s=m.get("ul_air_s"),
                                        receive_power_w=rx_w, dl_air_s=m.get("dl_air_s"),
                                        joules_per_token=per_token, drafted_tokens=entry.get("draft_len")))
        if budget is not None and m.get("tx_j") is not None:
            within = vocabulary.within(m["tx_j"], budget)
    entry["within_budget"] = within


def add_round_energy(record: dict) -> None:
    """The round's energy (in place): predicted and measured energy_j summed over its devices (null if any
    device's is unknown), and measured tokens_per_j."""
    devs = [d for d in record["devices"].values()]
    pred = [d["predicted"].get("energy_j") for d in devs]
    meas = [d["measured"].get("energy_j") for d in devs if d.get("measured") is not None]
    record["predicted"]["energy_j"] = sum(pred) if pred and None not in pred else None
    total = sum(meas) if meas and None not in meas else None
    record["measured"]["energy_j"] = total
    record["measured"]["tokens_per_j"] = formulas.tokens_per_joule(record["measured"].get("tokens"), total)
    record["predicted"]["tokens_per_j"] = formulas.tokens_per_joule(record["predicted"].get("tokens"),
                                                                    record["predicted"]["energy_j"])


def _add(acc: float | None, value: float | None) -> float | None:
    """A sum that stays unknown once one term is unknown."""
    return None if acc is None or value is None else acc + value


def summarize_energy(records: list[dict]) -> dict | None:
    """Per device and for the run, over the device-rounds that were measured: measured and predicted energy
    by term (J), tokens per joule, the budget and the rounds over it. None for records without energy fields
    (earlier releases)."""
    if not any("energy_j" in (r.get("measured") or {}) for r in records):
        return None
    keys = ("tx_j", "rx_j", "compute_j", "energy_j")
    devices: dict[str, dict] = {}
    for rec in records:
        for name, d in rec["devices"].items():
            s = devices.setdefault(name, {"rounds": 0, "tokens": 0, "predicted_tokens": 0.0, "budget_j": None,
                                          "over_budget": 0, "max_tx_j": None,
                                          **{f"{side}_{k}": 0.0 for side in ("measured", "predicted") for k in keys}})
            m = d.get("measured")
            if d.get("missed") or m is None:
                continue
            s["rounds"] += 1
            s["tokens"] += m.get("tokens") or 0
            s["predicted_tokens"] += d["predicted"].get("tokens") or 0.0
            for k in keys:
                s[f"measured_{k}"] = _add(s[f"measured_{k}"], m.get(k))
                s[f"predicted_{k}"] = _add(s[f"predicted_{k}"], d["predicted"].get(k))
            if d.get("energy_budget_j") is not None:
                s["budget_j"] = d["energy_budget_j"]
            s["over_budget"] += d.get("within_budget") is False
            if m.get("tx_j") is not None:
                s["max_tx_j"] = max(s["max_tx_j"] or 0.0, m["tx_j"])
    for s in devices.values():
        s["tokens_per_j"] = formulas.tokens_per_joule(s["tokens"], s["measured_energy_j"])
        s["predicted_tokens_per_j"] = formulas.tokens_per_joule(s["predicted_tokens"], s["predicted_energy_j"])
    run: dict = {"tokens": sum(s["tokens"] for s in devices.values()),
                 "over_budget": sum(s["over_budget"] for s in devices.values())}
    for side in ("measured", "predicted"):
        vals = [s[f"{side}_energy_j"] for s in devices.values()]
        run[f"{side}_energy_j"] = sum(vals) if vals and None not in vals else None
    run["tokens_per_j"] = formulas.tokens_per_joule(run["tokens"], run["measured_energy_j"])
    run["predicted_tokens_per_j"] = formulas.tokens_per_joule(sum(s["predicted_tokens"] for s in devices.values()),
                                                              run["predicted_energy_j"])
    return {"devices": devices, "run": run}
