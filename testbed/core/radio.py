"""Radio arithmetic shared by the model, the optimizer and the channel emulator (pure functions)."""

from __future__ import annotations

import math

import numpy as np


def db_to_linear(db):
    """10^(x/10): a power ratio in dB as a linear ratio (scalar or array)."""
    return 10.0 ** (np.asarray(db, dtype=float) / 10.0) if np.ndim(db) else 10.0 ** (db / 10.0)


def linear_to_db(x):
    """10 log10(x): a linear power ratio in dB (scalar or array)."""
    return 10.0 * np.log10(x) if np.ndim(x) else 10.0 * math.log10(x)


def dbm_to_w(dbm):
    """Power in dBm to W (0 dBm = 1 mW)."""
    return db_to_linear(dbm) / 1000.0


def w_to_dbm(w):
    """Power in W to dBm (1 W = 30 dBm)."""
    return linear_to_db(np.asarray(w, dtype=float) * 1000.0) if np.ndim(w) else linear_to_db(w * 1000.0)


def noise_psd_w_per_hz(noise_psd_dbm_hz: float = -174.0, noise_figure_db: float = 0.0) -> float:
    """Thermal noise density plus the receiver's noise figure, in W/Hz."""
    return dbm_to_w(noise_psd_dbm_hz + noise_figure_db)


def path_loss_db(distance_m, law: str = "3gpp_macro"):
    """Path loss in dB. `3gpp_macro`: 128.1 + 37.6 log10(d_km); `free_space_2ghz`: 38.5 + 20 log10(d_m)."""
    d = np.maximum(np.asarray(distance_m, dtype=float), 1.0)
    if law == "3gpp_macro":
        loss = 128.1 + 37.6 * np.log10(d / 1000.0)
    elif law == "free_space_2ghz":
        loss = 38.5 + 20.0 * np.log10(d)
    else:
        raise ValueError(f"unknown path-loss law {law!r}; allowed: 3gpp_macro, free_space_2ghz")
    return float(loss) if np.ndim(distance_m) == 0 else loss


def gain_from_distance_db(distance_m, law: str = "3gpp_macro"):
    """Channel power gain in dB (negative): minus the path loss."""
    return -path_loss_db(distance_m, law)


def shannon_rate_bps(bandwidth_hz, power_w, gain_linear, noise_psd_w_hz):
    """r = B log2(1 + p g / (N0 B)); zero bandwidth gives zero rate."""
    b = np.asarray(bandwidth_hz, dtype=float)
    snr = np.asarray(power_w, dtype=float) * np.asarray(gain_linear, dtype=float) / (
        noise_psd_w_hz * np.where(b > 0, b, 1.0)
    )
    # log2(1 + snr) loses digits below snr ~ 1e-3 (gains near -250 dB): log1p there
    spectral = np.where(snr < 1e-3, np.log1p(snr) / math.log(2.0), np.log2(1.0 + snr))
    rate = np.where(b > 0, b * spectral, 0.0)
    return float(rate) if rate.ndim == 0 else rate


def power_for_rate_w(bandwidth_hz, rate_bps, gain_linear, noise_psd_w_hz):
    """Inverse of `shannon_rate_bps`: the power that gives `rate_bps` (expm1 at low spectral efficiency)."""
    e = np.asarray(rate_bps / bandwidth_hz, dtype=float)
    with np.errstate(over="ignore"):
        snr = np.where(e < 1e-3, np.expm1(math.log(2.0) * e), 2.0 ** e - 1.0)
    return (noise_psd_w_hz * bandwidth_hz / gain_linear) * (snr if snr.ndim else float(snr))
