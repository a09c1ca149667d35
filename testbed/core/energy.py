"""A device's energy per round (pure): transmit, receive and compute, and the margin an energy budget needs.

- transmit: E^tx_k = p^U_k x (UL air time), J (W x s); the spec's energy of an upload (section 5, Option
  energy budget) when the air time is the modeled S / r^U_k(p).
- receive: E^rx_k = P^rx_k x (DL air time), J; P^rx_k is the device's receive power (a hardware constant).
- compute: E^cmp_k = e_k x L_k, J; e_k is the device's energy per drafted token (a hardware constant).

A term whose constant is unknown (None) is None, and so is the total: an unknown cost is not a free one.
"""

from __future__ import annotations

import math

# Hardware-profile fields of the energy model: name -> meaning with unit (errors and docs use these).
HARDWARE_ENERGY_FIELDS = {
    "joules_per_token": "compute energy per drafted token, J/token",
    "receive_power_w": "power drawn while receiving (DL air time), W",
}


def check_energy_field(key: str, value, where: str = "hardware") -> float:
    """A finite number >= 0 (not a boolean, not text), else a ValueError naming `where` and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key}={value!r} is not allowed; must be a finite number >= 0 "
                         f"({HARDWARE_ENERGY_FIELDS[key]})")
    return float(value)


def _known(*values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def transmit_energy_j(ul_power_w: float | None, ul_air_s: float | None) -> float | None:
    """E^tx = p^U x air time (J); None when either is unknown."""
    return float(ul_power_w * ul_air_s) if _known(ul_power_w, ul_air_s) else None


def receive_energy_j(receive_power_w: float | None, dl_air_s: float | None) -> float | None:
    """E^rx = P^rx x DL air time (J); None when either is unknown."""
    return float(receive_power_w * dl_air_s) if _known(receive_power_w, dl_air_s) else None


def compute_energy_j(joules_per_token: float | None, drafted_tokens: float | None) -> float | None:
    """E^cmp = e x L (J): energy per drafted token times the tokens drafted; None when either is unknown."""
    return float(joules_per_token * drafted_tokens) if _known(joules_per_token, drafted_tokens) else None


def device_energy(*, ul_power_w, ul_air_s, receive_power_w, dl_air_s, joules_per_token, drafted_tokens) -> dict:
    """{tx_j, rx_j, compute_j, energy_j} of one device and round; energy_j is None unless every term is known."""
    parts = {"tx_j": transmit_energy_j(ul_power_w, ul_air_s), "rx_j": receive_energy_j(receive_power_w, dl_air_s),
             "compute_j": compute_energy_j(joules_per_token, drafted_tokens)}
    known = [v for v in parts.values() if v is not None]
    parts["energy_j"] = float(sum(known)) if len(known) == len(parts) else None
    return parts


def tokens_per_joule(tokens: float | None, energy_j: float | None) -> float | None:
    """Tokens / J; None without a positive energy."""
    return float(tokens / energy_j) if _known(tokens, energy_j) and energy_j > 0 else None


def least_upload_energy_j(bits: float, gain: float, noise_psd_w_hz: float) -> float:
    """The infimum of p S / r(p) over p > 0: S N_0 ln 2 / g (J), approached as p -> 0. A budget below it
    admits no upload of S bits at all."""
    return float(bits * noise_psd_w_hz * math.log(2.0) / gain)


def budget_with_margin(budget_j: float, max_power_w: float, excess_air_s: float) -> float:
    """The budget to plan with so that the measured transmit energy stays within `budget_j` when the
    measured air time exceeds the modeled one by up to `excess_air_s`:

        p (S / r(p) + x) <= E  follows from  p S / r(p) <= E - P^max x,  since p <= P^max.

    Conservative (it charges the excess at P^max); never above the budget. May be <= 0: then no power keeps
    the device within its budget once the excess recurs."""
    return float(budget_j - max_power_w * max(0.0, excess_air_s))
