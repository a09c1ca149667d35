"""Channel state: seeded reproducibility, trace replay, live readings."""

import math

import numpy as np
import pytest
from scipy import stats

from testbed.channel.state import ChannelState, ProcNetWirelessReader, load_snr_trace

N0 = 10 ** ((-174 + 9 - 30) / 10)  # W/Hz, -174 dBm/Hz plus a 9 dB noise figure


DEVICES = [{"name": "d0", "distance_m": 100.0}, {"name": "d1", "distance_m": 300.0},
           {"name": "d2", "distance_m": 450.0}]


def model_cfg(**kw):
    return {"source": "model", "seed": 7, "shadowing_sigma_db": 8.0, "fading": "rayleigh",
            "noise_figure_db": 9.0, **kw}


def test_model_gains_are_reproducible_from_the_seed_and_order_independent():
    a = ChannelState.from_config(model_cfg(), DEVICES)
    b = ChannelState.from_config(model_cfg(), list(reversed(DEVICES)))
    rounds_a = [a.gains_db(r, 0.0) for r in range(5)]
    rounds_b = [b.gains_db(r, 0.0) for r in reversed(range(5))][::-1]  # queried in the other order
    assert rounds_a == rounds_b
    other = ChannelState.from_config(model_cfg(seed=8), DEVICES)
    assert other.gains_db(0, 0.0) != rounds_a[0]
    # Fading is redrawn per round; path loss and shadowing are not.
    assert rounds_a[0]["d0"] != rounds_a[1]["d0"]
    no_fading = ChannelState.from_config(model_cfg(fading="none"), DEVICES)
    assert no_fading.gains_db(0, 0.0) == no_fading.gains_db(3, 0.0)
    flat = ChannelState.from_config(model_cfg(fading="none", shadowing_sigma_db=0.0), DEVICES)
    assert flat.gains_db(0, 0.0)["d1"] == pytest.approx(-(128.1 + 37.6 * math.log10(0.3)))


def test_rayleigh_power_gain_is_exponential_and_shadowing_lognormal():
    # KS tests at a 0.1% false-alarm rate each, fixed seed.
    st = ChannelState.from_config(model_cfg(shadowing_sigma_db=0.0), [{"name": "d", "distance_m": 200.0}])
    pl = -(128.1 + 37.6 * math.log10(0.2))
    h = np.array([10 ** ((st.gains_db(r, 0.0)["d"] - pl) / 10) for r in range(2000)])
    assert stats.kstest(h, "expon").pvalue > 1e-3
    devs = [{"name": f"d{i}", "distance_m": 200.0} for i in range(1000)]
    sh = ChannelState.from_config(model_cfg(fading="none"), devs).gains_db(0, 0.0)
    x = np.array([sh[d["name"]] - pl for d in devs])
    assert stats.kstest(x / 8.0, "norm").pvalue > 1e-3


@pytest.mark.parametrize("kind", ["linear", "random_waypoint"])
def test_mobility_is_seeded_continuous_and_stays_in_the_cell(kind):
    cfg = model_cfg(fading="none", shadowing_sigma_db=0.0,
                    mobility={"kind": kind, "speed_mps": 30.0, "cell_radius_m": 500.0, "min_distance_m": 20.0})
    a = ChannelState.from_config(cfg, DEVICES)
    b = ChannelState.from_config(cfg, DEVICES)
    ts = np.arange(0, 120, 0.5)
    da = np.array([[a._impl.distance_m(d["name"], t) for t in ts] for d in DEVICES])
    db = np.array([[b._impl.distance_m(d["name"], t) for t in reversed(ts)][::-1] for d in DEVICES])
    assert np.array_equal(da, db)
    assert da.min() >= 20.0 - 1e-9 and da.max() <= 500.0 + 1e-9
    # Moves at most speed * dt between samples, and does move.
    assert np.abs(np.diff(da, axis=1)).max() <= 30.0 * 0.5 + 1e-6
    assert np.ptp(da, axis=1).min() > 10.0
    assert a.gains_db(0, 0.0) != a.gains_db(0, 60.0)


def write_trace(path):
    path.write_text("time_s,device,snr_db\n0.0,d0,20\n1.0,d0,10\n2.5,d0,5\n0.0,d1,3\n2.0,d1,-2\n")
    return path


def test_trace_replay_by_time_and_by_round(tmp_path):
    trace = write_trace(tmp_path / "snr.csv")
    devs = [{"name": "d0"}, {"name": "d1"}]
    st = ChannelState.from_config({"source": "trace", "trace": {"path": str(trace)}, "noise_figure_db": 9.0}, devs)
    # nearest earlier sample
    snr = {t: {k: st.gain_to_snr_db(k, g) for k, g in st.gains_db(0, t).items()} for t in (0.0, 0.99, 1.0, 2.2, 9.0)}
    assert snr[0.0] == pytest.approx({"d0": 20, "d1": 3})
    assert snr[0.99] == pytest.approx({"d0": 20, "d1": 3})
    assert snr[1.0] == pytest.approx({"d0": 10, "d1": 3})
    assert snr[2.2] == pytest.approx({"d0": 10, "d1": -2})
    assert snr[9.0] == pytest.approx({"d0": 5, "d1": -2})
    # snr = p g / (N0 B) with p = 23 dBm, B = 1 MHz: g_dB = snr - (23 - 30) + 10 log10(N0 B)
    assert st.gains_db(0, 0.0)["d0"] == pytest.approx(20 + 7 + 10 * math.log10(N0 * 1e6))
    by_round = ChannelState.from_config({"source": "trace", "trace": {"path": str(trace), "index": "round"}}, devs)
    seq = [by_round.gain_to_snr_db("d0", by_round.gains_db(r, 123.0)["d0"]) for r in range(5)]
    assert seq == pytest.approx([20, 10, 5, 5, 5])  # past the end: hold the last
    with pytest.raises(ValueError, match="before the first sample"):
        st.gains_db(0, -1.0)


def test_trace_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("t,dev,snr\n0,d0,1\n")
    with pytest.raises(ValueError, match="required: time_s"):
        load_snr_trace(bad)
    trace = write_trace(tmp_path / "snr.csv")
    with pytest.raises(ValueError, match=r"no samples for devices \['d9'\]"):
        ChannelState.from_config({"source": "trace", "trace": {"path": str(trace)}}, [{"name": "d9"}])
    with pytest.raises(ValueError, match="source='radar'"):
        ChannelState.from_config({"source": "radar"}, DEVICES)
    with pytest.raises(ValueError, match=r"devices\[d0\].distance_m"):
        ChannelState.from_config({"source": "model"}, [{"name": "d0"}])


def test_live_readings_and_proc_net_wireless(tmp_path):
    st = ChannelState.from_config({"source": "live"}, DEVICES)
    fallback = st.gains_db(0, 0.0)["d1"]
    assert fallback == pytest.approx(-(128.1 + 37.6 * math.log10(0.3)))  # path loss until a reading arrives
    st.report_live("d1", 12.5)
    assert st.gain_to_snr_db("d1", st.gains_db(1, 0.0)["d1"]) == pytest.approx(12.5)
    with pytest.raises(ValueError, match="unknown"):
        st.report_live("zz", 1.0)
    with pytest.raises(RuntimeError, match="does not exist"):
        ProcNetWirelessReader(path=str(tmp_path / "wireless")).read_snr_db()
    fake = tmp_path / "wireless"
    fake.write_text("Inter-| sta-|   Quality        |   Discarded packets\n"
                    " face | tus | link level noise |  nwid  crypt   frag  retry   misc | beacon | 22\n"
                    " wlan0: 0000   54.  -56.  -95.        0      0      0      0      0        0\n")
    assert ProcNetWirelessReader(path=str(fake)).read_snr_db() == pytest.approx(39.0)
    with pytest.raises(RuntimeError, match="'wlan9'"):
        ProcNetWirelessReader("wlan9", path=str(fake)).read_snr_db()


def test_snr_reference_uses_the_scenario_device_fields(tmp_path):
    trace = write_trace(tmp_path / "snr.csv")
    devs = [{"name": "d0", "max_power_w": 0.1, "uplink_bandwidth_hz": 2e6}, {"name": "d1"}]
    st = ChannelState.from_config({"source": "trace", "trace": {"path": str(trace)}, "noise_figure_db": 9.0,
                                   "snr_reference": {"power_dbm": 30.0, "bandwidth_hz": 5e5}}, devs)
    g = st.gains_db(0, 0.0)
    # d0: 20 dB = 0.1 W * g / (N0 * 2 MHz); d1 falls back to snr_reference (1 W, 500 kHz): 3 dB.
    assert 10 ** (g["d0"] / 10) == pytest.approx(10 ** 2.0 * N0 * 2e6 / 0.1)
    assert 10 ** (g["d1"] / 10) == pytest.approx(10 ** 0.3 * N0 * 5e5 / 1.0)


DRAFTER = {"draft_time_s": 0.01, "acceptance": 0.7}


def test_a_run_reads_snrs_with_the_scenarios_noise_power_and_bandwidth():
    # The model must predict the SNR a device measured: the state's SNR -> gain uses the scenario's noise
    # figure (9 dB here, the state's own default is 0) and the device's power and UL bandwidth (2 MHz here).
    from testbed.core.scenario import Scenario
    from testbed.runtime.plugins import channel_state_from_config

    sc = Scenario.from_dict({"noise_figure_db": 9.0, "uplink_bandwidth_hz": 2e6,
                             "devices": [{"name": "d0", "distance_m": 100, "max_power_w": 0.1, **DRAFTER},
                                         {"name": "d1", "distance_m": 200, "uplink_bandwidth_hz": 5e5, **DRAFTER}]})
    devices = [{"name": "d0", "distance_m": 100}, {"name": "d1", "distance_m": 200}]
    st = channel_state_from_config({"source": "live"}, devices, sc)
    for name, p_w, b_hz in (("d0", 0.1, 2e6), ("d1", 0.2, 5e5)):
        st.report_live(name, 20.0)
        g_db = st.gains_db(0, 0.0)[name]
        modeled = 10 * math.log10(p_w * 10 ** (g_db / 10) / (sc.noise_psd_w_hz * b_hz))
        assert modeled == pytest.approx(20.0, abs=1e-9), name
    # A state that names its own noise keeps it: 9 dB less noise, 9 dB less gain for the same SNR.
    own = channel_state_from_config({"source": "live", "noise_figure_db": 0.0}, devices, sc)
    own.report_live("d0", 20.0)
    assert own.gains_db(0, 0.0)["d0"] == pytest.approx(st.gains_db(0, 0.0)["d0"] - 9.0)
