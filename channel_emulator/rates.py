"""Per-link rates from channel gains and a schedule: a thin layer over `testbed.core.radio` Shannon rates.

UL: each device has its own FDMA sub-band: r^U_k = B^U_k log2(1 + p^U_k g_k / (N0 B^U_k)).
DL (``dl_access``):
- ``fdma_equal_split``: the DL-mode devices share B^D equally (W = B^D / |D|), each at its p^D_k;
- ``fdma_fixed_split``: every device owns W = B^D / N whatever its mode;
- ``tdma``: each DL-mode device uses the whole band B^D (at p^D_k, or P_s when not given) in turn; the
  emulator serialises the DL messages on one link.
A device with no DL allocation (UL mode under fdma_equal_split / tdma) gets ``reply_rate_bps`` (None =
its small replies are not charged air time).
"""

from __future__ import annotations

from typing import Any

from channel_emulator.checks import DL_ACCESS, finite_number
from testbed.core import model, radio

MODES = ("UL", "DL")


def _num(field: str, value: Any, allowed: str = "a finite number > 0") -> float:
    return finite_number(f"rates: {field}", value, allowed=allowed)


def link_rates(gains_db: dict[str, float], schedule: dict[str, dict], *, dl_access: str = "fdma_equal_split",
               ul_bandwidth_hz: float | dict[str, float] = 1e6, dl_bandwidth_hz: float = 20e6,
               dl_total_power_w: float = 10.0, noise_w_hz: float | None = None,
               reply_rate_bps: float | None = None) -> dict[str, dict[str, float | None]]:
    """Rates per device: ``{name: {"ul_rate_bps", "dl_rate_bps"}}``.

    ``schedule[name]`` = ``{"mode": "UL"|"DL", "ul_power_w": p^U_k, "dl_power_w": p^D_k}`` (dl_power_w may
    be omitted for UL-mode devices; under tdma it defaults to ``dl_total_power_w``).
    """
    if dl_access not in DL_ACCESS:
        raise ValueError(f"rates: dl_access={dl_access!r} is invalid; allowed: {', '.join(DL_ACCESS)}")
    if noise_w_hz is None:
        noise_w_hz = radio.noise_psd_w_per_hz(-174.0, 0.0)
    unknown = sorted(set(schedule) - set(gains_db))
    if unknown:
        raise ValueError(f"rates: schedule names devices {unknown} with no channel gain; known: {sorted(gains_db)}")
    for name, s in schedule.items():
        if s.get("mode") not in MODES:
            raise ValueError(f"rates: schedule[{name!r}].mode={s.get('mode')!r} is invalid; allowed: UL, DL")
    n_dl = sum(1 for s in schedule.values() if s["mode"] == "DL")
    b_dl = _num("dl_bandwidth_hz", dl_bandwidth_hz)
    w = float(model.dl_bandwidth_split(dl_access, b_dl, n_dl, len(schedule)))  # the band of each DL receiver
    out: dict[str, dict[str, float | None]] = {}
    for name, s in schedule.items():
        g = radio.db_to_linear(float(gains_db[name]))
        b_ul = _num(f"ul_bandwidth_hz[{name}]",
                    ul_bandwidth_hz[name] if isinstance(ul_bandwidth_hz, dict) else ul_bandwidth_hz)
        p_ul = _num(f"schedule[{name!r}].ul_power_w", s.get("ul_power_w"))
        ul = float(radio.shannon_rate_bps(b_ul, p_ul, g, noise_w_hz))
        dl: float | None = reply_rate_bps
        if dl_access == "fdma_fixed_split":
            p_dl = s.get("dl_power_w", dl_total_power_w / len(schedule))
            dl = float(radio.shannon_rate_bps(w, _num(f"schedule[{name!r}].dl_power_w", p_dl), g, noise_w_hz))
        elif s["mode"] == "DL":
            default_p = dl_total_power_w / n_dl if dl_access == "fdma_equal_split" else dl_total_power_w
            p_dl = _num(f"schedule[{name!r}].dl_power_w", s.get("dl_power_w", default_p))
            dl = float(radio.shannon_rate_bps(w, p_dl, g, noise_w_hz))
        out[name] = {"ul_rate_bps": ul, "dl_rate_bps": dl}
    return out
