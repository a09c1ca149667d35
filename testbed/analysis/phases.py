"""The phases a report compares, predicted against measured, under the records' names (and the old names
that earlier releases wrote)."""

from __future__ import annotations

from testbed.core.vocabulary import LEGACY_DEVICE_FIELDS

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
