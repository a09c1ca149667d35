"""Trace replay (testbed.channel.traces and the trace / live sources of ChannelState): every format's
parsing and units, malformed lines named by file and line, replay by time and by round, looped or held,
rate overrides, the shipped example traces, and live readings with staleness and fallbacks."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

from testbed import PROFILES_DIR
from testbed.channel.state import ChannelState
from testbed.channel.traces import (
    TraceError,
    detect_format,
    load_entry,
    load_lumos5g,
    load_mahimahi,
    load_throughput_csv,
    load_ucc,
)
from testbed.core import radio

N0 = 10 ** ((-174 - 30) / 10)  # W/Hz: the state's default noise (-174 dBm/Hz, 0 dB noise figure)
UCC_HEADER = ("Timestamp,Longitude,Latitude,Speed,Operatorname,CellID,NetworkMode,RSRP,RSRQ,SNR,CQI,RSSI,"
              "DL_bitrate,UL_bitrate,State,PINGAVG,PINGMIN,PINGMAX,PINGSTDEV,PINGLOSS,CELLHEX,NODEHEX,LACHEX,"
              "RAWCELLID,NRxRSRP,NRxRSRQ")
LUMOS_HEADER = ("run_num,seq_num,abstractSignalStr,latitude,longitude,movingSpeed,compassDirection,nrStatus,"
                "lte_rssi,lte_rsrp,lte_rsrq,lte_rssnr,nr_ssRsrp,nr_ssRsrq,nr_ssSinr,Throughput,mobility_mode,"
                "trajectory_direction,tower_id")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def ucc_row(stamp, snr, dl, ul, state):
    return f"{stamp},-8.4,51.9,0,A,12,LTE,-95,-10,{snr},12,-,{dl},{ul},{state},-,-,-,-,-,C,A,B,1,-,-"


def lumos_row(run, seq, sinr, tput, mode="walking", direction="CW"):
    return f"{run},{seq},3,44.97,-93.25,1.2,90,CONNECTED,-61,-90,-11,5,-85,-11,{sinr},{tput},{mode},{direction},7"


# --- formats ----------------------------------------------------------------------------------------------

def test_mahimahi_counts_opportunities_per_bin_and_wraps_at_the_last_timestamp(tmp_path):
    # 0-100 ms: 3 packets (two in ms 5: repeated timestamps are more capacity); 100-200 ms: 1; 200-250: 1.
    f = write(tmp_path / "x.up", "5\n5\n99\n150\n\n250\n")
    s = load_mahimahi(f, bin_s=0.1)
    assert s.kind == "rate_bps" and s.period_s == pytest.approx(0.25) and s.wraps
    assert s.values.tolist() == pytest.approx([3 * 12000 / 0.1, 12000 / 0.1, 12000 / 0.05])  # last bin is 50 ms
    assert s.at_time(0.12) == pytest.approx(120e3)
    assert s.at_time(0.25 + 0.12, loop=True) == pytest.approx(120e3)  # one period later, the same bin
    assert s.at_time(5.0, loop=False) == pytest.approx(240e3)  # held at the last bin
    assert s.at_index(4, loop=True) == pytest.approx(120e3)  # round 4 -> bin 4 mod 3
    assert detect_format(f) == "mahimahi"


@pytest.mark.parametrize("text,line,match", [
    ("1\n2\nabc\n", 3, "not a timestamp"),
    ("1\n5\n4\n", 3, "before the previous one"),
    ("1\n-3\n", 2, "not a timestamp"),
])
def test_mahimahi_malformed_lines_name_file_and_line(tmp_path, text, line, match):
    f = write(tmp_path / "bad.up", text)
    with pytest.raises(TraceError, match=rf"bad.up:{line}: .*{match}"):
        load_mahimahi(f)
    with pytest.raises(TraceError, match="no timestamps"):
        load_mahimahi(write(tmp_path / "empty.up", "\n"))


def test_throughput_csv_with_and_without_header(tmp_path):
    s = load_throughput_csv(write(tmp_path / "t.csv", "time_s,mbps\n0,10\n1.0,2.5\n3,0\n"))
    assert s.values.tolist() == [10e6, 2.5e6, 0.0] and s.period_s == pytest.approx(5.0)  # last gap repeated
    assert s.at_time(2.9) == 2.5e6 and s.at_time(-1.0) == 10e6  # before the first sample: the first value
    assert s.at_time(5.5, loop=True) == 10e6 and s.at_time(5.5, loop=False) == 0.0
    kbps = load_throughput_csv(write(tmp_path / "k.csv", "time,kbps\n0,800\n"))
    assert kbps.values.tolist() == [800e3]
    bare = load_throughput_csv(write(tmp_path / "cooked.txt", "0.0 4.0\n0.5\t6.0\n"))  # Pensieve style
    assert bare.values.tolist() == [4e6, 6e6] and bare.times_s.tolist() == [0.0, 0.5]
    assert detect_format(tmp_path / "t.csv") == "throughput_csv" == detect_format(tmp_path / "cooked.txt")


def test_throughput_csv_errors_name_file_and_line(tmp_path):
    with pytest.raises(TraceError, match=r"t.csv:3: rate='fast' is not a number"):
        load_throughput_csv(write(tmp_path / "t.csv", "time_s,mbps\n0,1\n1,fast\n"))
    with pytest.raises(TraceError, match=r"n.csv:2: rate -1.0 < 0"):
        load_throughput_csv(write(tmp_path / "n.csv", "time_s,mbps\n0,-1\n"))
    with pytest.raises(TraceError, match=r"c.csv:1: columns .*required: time_s"):
        load_throughput_csv(write(tmp_path / "c.csv", "when,speed\n0,1\n"))
    with pytest.raises(TraceError, match=r"s.csv:2: 1 fields"):
        load_throughput_csv(write(tmp_path / "s.csv", "time_s,mbps\n7\n"))


def test_ucc_columns_units_state_filter_and_duplicate_seconds(tmp_path):
    rows = [UCC_HEADER,
            ucc_row("2019.12.14_10.00.00", 8, 20000, 100, "D"),
            ucc_row("2019.12.14_10.00.00", 10, 30000, 300, "D"),  # same second: averaged
            ucc_row("2019.12.14_10.00.01", 11, 900, 50, "I"),  # idle: not a capacity sample
            ucc_row("2019.12.14_10.00.02", "-", "-", 200, "D"),  # missing: skipped in that column
            ucc_row("2019.12.14_10.00.03", 4, 5000, 400, "D")]
    f = write(tmp_path / "ucc.csv", "\n".join(rows) + "\n")
    dl = load_ucc(f, "dl")
    assert dl.times_s.tolist() == [0.0, 3.0] and dl.values.tolist() == [25e6, 5e6]  # kbit/s -> bit/s
    ul = load_ucc(f, "ul")
    assert ul.times_s.tolist() == [0.0, 2.0, 3.0] and ul.values.tolist() == [200e3, 200e3, 400e3]
    assert load_ucc(f, "dl", state="any").times_s.tolist() == [0.0, 1.0, 3.0]
    snr = load_ucc(f, "snr")
    assert snr.kind == "snr_db" and snr.values.tolist() == [9.0, 11.0, 4.0]  # SNR keeps idle rows
    assert detect_format(f) == "ucc"
    with pytest.raises(TraceError, match="column='RSRP' is not usable"):
        load_ucc(f, "snr", column="RSRP")
    bad = write(tmp_path / "bad.csv", "\n".join([UCC_HEADER, ucc_row("2019.12.14_10.00.00", 8, "2O000", 1, "D")]))
    with pytest.raises(TraceError, match=r"bad.csv:2: DL_bitrate='2O000' is not a number"):
        load_ucc(bad, "dl")
    stamp = write(tmp_path / "stamp.csv", "\n".join([UCC_HEADER, ucc_row("14/12/2019 10:00", 8, 1, 1, "D")]))
    with pytest.raises(TraceError, match=r"stamp.csv:2: Timestamp='14/12/2019 10:00'"):
        load_ucc(stamp, "dl")


def test_lumos5g_runs_filters_units_and_missing_values(tmp_path):
    rows = [LUMOS_HEADER,
            lumos_row(3, 10, 12.0, 800.5), lumos_row(3, 11, "", 700), lumos_row(3, 12, 9.0, 0),
            lumos_row(4, 1, 20.0, 1500, mode="driving"), lumos_row(4, 2, 21.0, 1400, mode="driving")]
    f = write(tmp_path / "lumos.csv", "\n".join(rows) + "\n")
    dl = load_lumos5g(f, "dl")  # the first run in the file, seq_num from 0
    assert dl.times_s.tolist() == [0.0, 1.0, 2.0] and dl.values.tolist() == [800.5e6, 700e6, 0.0]
    snr = load_lumos5g(f, "snr")
    assert snr.times_s.tolist() == [0.0, 2.0] and snr.values.tolist() == [12.0, 9.0]  # empty SINR skipped
    assert load_lumos5g(f, "dl", run=4).values.tolist() == [1500e6, 1400e6]
    assert load_lumos5g(f, "dl", mobility_mode="driving").values.tolist() == [1500e6, 1400e6]
    assert load_lumos5g(f, "snr", column="lte_rssnr").values.tolist() == [5.0, 5.0, 5.0]
    assert detect_format(f) == "lumos5g"
    with pytest.raises(TraceError, match="no default column for 'ul'"):
        load_lumos5g(f, "ul")
    assert load_lumos5g(f, "ul", column="Throughput").kind == "rate_bps"
    with pytest.raises(TraceError, match=r"run=9 not found; runs: \[3, 4\]"):
        load_lumos5g(f, "dl", run=9)
    bad = write(tmp_path / "bad.csv", "\n".join([LUMOS_HEADER, lumos_row(1, 0, 3.0, "fast")]))
    with pytest.raises(TraceError, match=r"bad.csv:2: Throughput='fast'"):
        load_lumos5g(bad, "dl")


def test_entry_checks_role_against_the_trace_kind(tmp_path):
    f = write(tmp_path / "t.csv", "time_s,mbps\n0,10\n")
    with pytest.raises(TraceError, match="role 'snr' needs a snr_db trace"):
        load_entry({"path": str(f)}, "snr", "d0", "trace.devices[d0].snr")
    with pytest.raises(TraceError, match=r"unknown keys \['colum'\]"):
        load_entry({"path": str(f), "colum": "x"}, "ul", "d0", "trace.devices[d0].ul")
    assert load_entry({"path": str(f), "scale": 0.5}, "ul", "d0", "f").values.tolist() == [5e6]


# --- ChannelState with traces ----------------------------------------------------------------------------

def test_rate_traces_fix_rates_and_snr_traces_give_gains(tmp_path):
    up = write(tmp_path / "a.up", "0\n0\n0\n50\n100\n")  # 5 packets per 100 ms pass = 600 kbit/s
    dl = write(tmp_path / "dl.csv", "time_s,mbps\n0,20\n1,5\n")
    snr = write(tmp_path / "snr.csv", "time_s,device,snr_db\n0,d1,15\n1,d1,3\n")
    devices = [{"name": "d0", "max_power_w": 0.2}, {"name": "d1"}, {"name": "d2"}]
    cfg = {"source": "trace", "trace": {"devices": {
        "d0": {"ul": str(up), "dl": {"path": str(dl), "format": "throughput_csv"}},
        "d1": {"snr": str(snr)}, "*": {"dl": str(dl)}}}}
    with pytest.raises(ValueError, match=r"devices \['d2'\] have neither an snr nor a ul trace"):
        ChannelState.from_config(cfg, devices)  # d2 gets only '*' (a DL rate), and it has no distance_m
    devices[2]["distance_m"] = 100.0  # now d2's gain can fall back on the path loss
    st = ChannelState.from_config(cfg, devices)
    assert st.fixed_rates == {"d0": {"ul": True, "dl": True}, "d1": {"ul": False, "dl": False},
                              "d2": {"ul": False, "dl": True}}
    ov = st.rate_override_bps(0, 1.5)
    assert ov["d0"] == {"ul": pytest.approx(600e3), "dl": 5e6} and ov["d1"] == {"ul": None, "dl": None}
    assert ov["d2"] == {"ul": None, "dl": 5e6}
    g = st.gains_db(0, 1.5)
    assert st.gain_to_snr_db("d1", g["d1"]) == pytest.approx(3.0)
    assert g["d2"] == pytest.approx(-(128.1 + 37.6 * math.log10(0.1)))  # mean path loss at 100 m
    other = ChannelState.from_config({"source": "trace", "trace": {"devices": {
        "*": {"snr": {"path": str(snr), "device": "d1", "format": "snr_csv"}}}}}, [{"name": "x"}])
    assert other.gain_to_snr_db("x", other.gains_db(0, 0.5)["x"]) == pytest.approx(15.0)
    # '*' with a multi-device SNR CSV: each device reads its own rows.
    both = write(tmp_path / "both.csv", "time_s,device,snr_db\n0,p,1\n0,q,2\n")
    st2 = ChannelState.from_config({"source": "trace", "trace": {"devices": {"*": {"snr": str(both)}}}},
                                   [{"name": "p"}, {"name": "q"}])
    assert {k: round(st2.gain_to_snr_db(k, g), 9) for k, g in st2.gains_db(0, 0.0).items()} == {"p": 1, "q": 2}
    # d0 has only a UL rate: its gain gives exactly that Shannon rate at its reference power (0.2 W, 1 MHz).
    ul = radio.shannon_rate_bps(1e6, 0.2, radio.db_to_linear(g["d0"]), st.noise_w_hz)
    assert ul == pytest.approx(600e3, rel=1e-9)


def test_trace_replay_by_round_looped_or_held_and_rate_floor(tmp_path):
    tput = write(tmp_path / "t.csv", "time_s,mbps\n0,1\n1,0\n2,3\n")
    devs = [{"name": "d0", "distance_m": 100.0}]
    held = ChannelState.from_config({"source": "trace", "trace": {"index": "round", "devices": {
        "d0": {"ul": str(tput)}}}}, devs)
    assert [held.rate_override_bps(r, 0.0)["d0"]["ul"] for r in range(5)] == [1e6, 1e4, 3e6, 3e6, 3e6]
    looped = ChannelState.from_config({"source": "trace", "trace": {"index": "round", "loop": True,
                                                                    "min_rate_bps": 5e3,
                                                                    "devices": {"d0": {"ul": str(tput)}}}}, devs)
    assert [looped.rate_override_bps(r, 0.0)["d0"]["ul"] for r in range(5)] == [1e6, 5e3, 3e6, 1e6, 5e3]
    by_time = ChannelState.from_config({"source": "trace", "trace": {"loop": True, "devices": {
        "d0": {"ul": str(tput)}}}}, devs)
    assert by_time.rate_override_bps(0, 3.5)["d0"]["ul"] == 1e6  # one pass = 3 s
    with pytest.raises(ValueError, match="trace.loop"):
        ChannelState.from_config({"source": "trace", "trace": {"loop": "yes", "devices": {"d0": {}}}}, devs)
    with pytest.raises(ValueError, match=r"trace.devices=\['zz'\]"):
        ChannelState.from_config({"source": "trace", "trace": {"devices": {"zz": {"ul": str(tput)}}}}, devs)
    with pytest.raises(TraceError, match="not found; looked in"):
        ChannelState.from_config({"source": "trace", "trace": {"devices": {"d0": {"ul": "nope.up"}}}}, devs)
    model = ChannelState.from_config({"source": "model", "fading": "none"}, devs)
    assert model.rate_override_bps(0, 0.0) == {"d0": {"ul": None, "dl": None}}
    assert model.fixed_rates == {"d0": {"ul": False, "dl": False}}


@pytest.mark.live
def test_shipped_example_traces_load_by_profile_relative_path_and_are_reproducible(tmp_path):
    devs = [{"name": "a"}, {"name": "b"}]
    st = ChannelState.from_config({"source": "trace", "trace": {"devices": {
        "*": {"ul": "traces/example-ar1-6mbps.up", "dl": "traces/example-walk-30mbps.csv"}}}}, devs)
    rates = [st.rate_override_bps(0, t)["a"]["ul"] for t in [0.1 * k for k in range(400)]]
    assert 3e6 < sorted(rates)[len(rates) // 2] < 12e6  # median near the generator's 6 Mbit/s
    assert st.rate_override_bps(0, 20.05)["a"]["ul"] == rates[0]  # mahimahi wraps after its 20 s
    assert st.rate_override_bps(0, 32.0)["b"]["dl"] == 2e6  # the handover dip
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "make_example_traces.py"), "--check",
                          "--out", str(PROFILES_DIR / "traces")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# --- live readings -------------------------------------------------------------------------------------------

def test_live_staleness_and_each_fallback():
    devs = [{"name": "d0", "distance_m": 200.0}, {"name": "d1", "distance_m": 300.0}]
    pl = -(128.1 + 37.6 * math.log10(0.2))
    for fallback, stale_source, stale_gain in (("model", "model", pl), ("last", "last", "reading"),
                                               ("drop", "drop", None)):
        st = ChannelState.from_config({"source": "live", "live": {"max_age_s": 2.0, "fallback": fallback}}, devs)
        first = st.gains_db(0, 0.0)  # nothing reported yet
        if fallback == "drop":
            assert first == {} and st.live_used("d0")["source"] == "drop"
        else:
            assert first["d0"] == pytest.approx(pl) and st.live_used("d0")["source"] == "model"
        assert st.report_live("d0", {"snr_db": 20.0, "source": "file:/tmp/x"}, t_s=10.0)
        g = st.gains_db(1, 11.5)
        assert st.gain_to_snr_db("d0", g["d0"]) == pytest.approx(20.0)
        assert st.live_used("d0") == {"round": 1, "age_s": 1.5, "probe": "file:/tmp/x", "error": None,
                                      "value": 20.0, "source": "live"}
        g = st.gains_db(2, 12.5)  # 2.5 s old: stale
        used = st.live_used("d0")
        assert used["source"] == stale_source and used["age_s"] == pytest.approx(2.5)
        if stale_gain is None:
            assert "d0" not in g and used["value"] is None
        elif stale_gain == "reading":
            assert used["value"] == 20.0 and st.gain_to_snr_db("d0", g["d0"]) == pytest.approx(20.0)
        else:
            assert g["d0"] == pytest.approx(stale_gain)
            assert used["value"] == pytest.approx(st.gain_to_snr_db("d0", pl))


def test_live_measurements_failures_and_signal_minus_noise():
    st = ChannelState.from_config({"source": "live", "live": {"fallback": "last"}},
                                  [{"name": "d0", "distance_m": 50.0}])
    assert st.report_live("d0", {"snr_db": None, "signal_dbm": -60.0, "noise_dbm": -92.0, "source": "iw"})
    assert st.gain_to_snr_db("d0", st.gains_db(0, 0.0)["d0"]) == pytest.approx(32.0)
    # A failed probe is a value: it returns False, the previous reading stays, and the error is recorded.
    assert not st.report_live("d0", {"snr_db": None, "error": "no answer within 0.5 s", "source": "command:x"})
    assert st.gain_to_snr_db("d0", st.gains_db(1, 1.0)["d0"]) == pytest.approx(32.0)
    assert st.live_used("d0")["error"] == "no answer within 0.5 s"

    class Reading:  # any object with the fields, e.g. device_node.link_probe.LinkMeasurement
        snr_db, source = 7.5, "linux-wireless:wlan0"

    assert st.report_live("d0", Reading())  # no t_s: stamped with the last gains_db time (1.0)
    st.gains_db(2, 4.0)
    assert st.live_used("d0")["age_s"] == pytest.approx(3.0) and st.live_used("d0")["value"] == 7.5
    with pytest.raises(ValueError, match="allowed: a finite number"):
        st.report_live("d0", float("nan"))
    with pytest.raises(ValueError, match=r"live.fallback='guess'"):
        ChannelState.from_config({"source": "live", "live": {"fallback": "guess"}}, [{"name": "d0"}])
    with pytest.raises(ValueError, match=r"live.max_age_s=-1"):
        ChannelState.from_config({"source": "live", "live": {"max_age_s": -1}}, [{"name": "d0"}])
    no_distance = ChannelState.from_config({"source": "live", "live": {"max_age_s": 1.0}}, [{"name": "d0"}])
    no_distance.report_live("d0", 10.0, t_s=0.0)
    with pytest.raises(ValueError, match="its reading is 5 s old"):
        no_distance.gains_db(0, 5.0)
