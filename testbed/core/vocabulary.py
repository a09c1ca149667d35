"""The testbed's one vocabulary: modes, link directions, the phases of a round and their record fields,
and the relative tolerance of the model's bounds. Every layer names these from here."""

from __future__ import annotations

UL, DL = "UL", "DL"
MODES = (UL, DL)
"""A device's mode: UL uploads its draft distributions and the edge corrects; DL downloads p, the device corrects."""

UPLINK, DOWNLINK = "ul", "dl"
DIRECTIONS = (UPLINK, DOWNLINK)
"""A link's direction, as the wire's ``air`` field and the channel's rates name it."""

PHASE_FIELDS = {
    "draft_s": "drafting on the device (compute, including an emulated slowdown)",
    "ul_air_s": "air time of the draft upload (its queueing and base latency included)",
    "uplink_phase_s": "draft_s + ul_air_s (round level: the largest over the devices)",
    "verify_s": "the one batched verification on the edge",
    "dl_air_s": "after verification: the verdict's DL air time (DL mode), the reply time c_r (UL mode)",
    "downlink_phase_s": "round level: the largest dl_air_s (measured: over DL-mode verdicts carrying p_j)",
    "round_s": "the round, schedules out to the last report",
}
"""The phases of a round, under the names that plans, round records and reports use (seconds)."""

LEGACY_DEVICE_FIELDS = {"ul_air_s": "uplink_s", "uplink_phase_s": "up_phase_s", "dl_air_s": "downlink_s"}
"""Record fields that earlier releases wrote: new name -> old name (readers accept both)."""

REL_TOL = 1e-9
"""Relative slack on a bound checked in floating point (a power at its maximum, a sum at its budget)."""


def within(value, bound, rel_tol: float = REL_TOL):
    """value <= bound up to the relative rounding slack (works on numpy arrays element-wise)."""
    return value <= bound * (1 + rel_tol)
