"""The phases a report compares, predicted against measured, under the records' names (and the old names
that earlier releases wrote)."""

from __future__ import annotations

from testbed.core.vocabulary import DL, LEGACY_DEVICE_FIELDS

# The phases compared, under the record's vocabulary (edge_node.controller.PHASE_FIELDS); a bracket narrows the
# samples: phase -> (where, key, unit). Device phases are compared per device and round; UL air time per mode
# (a DL-mode upload is a few hundred bytes, a UL-mode one megabytes); DL air time only where a distribution
# actually went down (a DL-mode device that rejected).
PHASES = {
    "draft_s": ("device", "draft_s", "s"),
    "ul_air_s[UL mode]": ("device", "ul_air_s", "s"),
    "ul_air_s[DL mode]": ("device", "ul_air_s", "s"),
    "uplink_phase_s": ("device", "uplink_phase_s", "s"),
    "dl_air_s[DL mode, p]": ("device", "dl_air_s", "s"),
    "verify_s": ("round", "verify_s", "s"),
    "round_s": ("round", "round_s", "s"),
    "goodput_tps": ("round", "goodput_tps", "tok/s"),
}
# Records of earlier releases carry the old names only: new name -> old name.
LEGACY = LEGACY_DEVICE_FIELDS


def _field(times: dict, key: str):
    """A phase time of a device entry, under its name or (older records) its old name."""
    return times[key] if key in times else times.get(LEGACY.get(key, key))


def phase_pairs(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(predicted, measured) pairs per phase."""
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in PHASES}
    for rec in records:
        for phase, (where, key, _) in PHASES.items():
            if where == "round":
                p, m = rec["predicted"].get(key), rec["measured"].get(key)
                if p is not None and m is not None:
                    out[phase].append((p, m))
                continue
            for dev in rec["devices"].values():
                if dev.get("missed") or not dev.get("measured"):
                    continue
                if "[UL mode" in phase and dev["mode"] != "UL":
                    continue
                if "[DL mode" in phase and dev["mode"] != "DL":
                    continue
                if phase.startswith("dl_air") and dev.get("dl_payload") != "p":
                    continue
                p, m = _field(dev["predicted"], key), _field(dev["measured"], key)
                if p is not None and m is not None:
                    out[phase].append((p, m))
    return out


# What the rates of a round's prediction rest on (`prediction_basis`): the model's (the emulator charges the
# rates the plan chose), a rate trace's, the edge's measurement of a real link, or nothing (a real link the
# edge did not measure: the model's rates are a guess about it).
RATE_BASES = ("model", "trace", "measured link", "none")
NO_LINK_BASIS = "passthrough link not measured; set channel.measure_links: true"
# Phases whose prediction includes air time: without a basis for the rates there is nothing to compare.
RATE_PHASES = ("ul_air_s[UL mode]", "ul_air_s[DL mode]", "uplink_phase_s", "dl_air_s[DL mode, p]", "round_s",
               "goodput_tps")


def _link_measured(dev: dict) -> bool:
    """A device's real link was measured in the directions its plan needs (the UL; the DL in DL mode)."""
    src = dev.get("link_rate_source") or {}
    fixed = dev.get("link_rate_bps") or {}
    need = ("ul", "dl") if dev.get("mode") == DL else ("ul",)
    return all(src.get(x) in ("rounds", "probe") if src else bool(fixed.get(x)) for x in need)


def round_rate_basis(rec: dict) -> str:
    """What one round's rates rest on (`RATE_BASES`): a rate trace fixed a link (`trace_rate_bps`); a
    passthrough link (no emulator) the edge measured for every device (`link_rate_source`), or not; else the
    model's rates, which the emulator charges."""
    devices = list((rec.get("devices") or {}).values())
    if any(d.get("trace_rate_bps") for d in devices):
        return "trace"
    if rec.get("channel_mode") == "passthrough":
        return "measured link" if devices and all(_link_measured(d) for d in devices) else "none"
    return "model"
