"""Link measurement: the rate probe's math on synthetic round trips, its server and client over loopback and
the `multispin channel probe` command; the device-side SNR probes (file, command, linux-wireless, none),
whose failures are values, never exceptions."""

import ast
import json
import random
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from support import ROOT, wait_until

from channel_emulator.link_probe import (
    HEADER,
    MAGIC,
    ProbeClient,
    ProbeError,
    ProbeServer,
    fit_sweep,
    latency_stats,
    parse_endpoint,
    run_probe,
)
from device_node.link_probe import (
    BackgroundProbe,
    CommandProbe,
    FileProbe,
    LinkMeasurement,
    LinuxWirelessProbe,
    NoneProbe,
    make_probe,
    parse_iw_link,
    parse_iw_survey,
)
from testbed.channel.state import ChannelState
from testbed.cli import main

# --- the rate probe's math ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rate_bps", [1e5, 2e6, 8e6, 20e6, 1e9])
def test_fit_recovers_the_rate_within_1_percent_from_noisy_round_trips(rate_bps):
    rng = random.Random(int(rate_bps))
    top = int(0.25 * rate_bps / 8)  # as the sweep picks: the size whose transfer takes 0.25 s
    sizes = [int(top * (0.25 + 0.75 * i / 4)) for i in range(5)] * 3
    # Fixed cost 2 ms, plus one-sided noise (queueing, scheduling: mean 1 ms, tails of several ms).
    rtts = [0.002 + 8 * s / rate_bps + rng.expovariate(1000.0) for s in sizes]
    fit = fit_sweep(sizes, rtts)
    assert fit.rate_bps == pytest.approx(rate_bps, rel=0.01)
    assert fit.intercept_s == pytest.approx(0.002, abs=0.002) and len(fit.sizes_bytes) == 5


def test_fit_slope_ignores_a_token_bucket_burst():
    # A full bucket of B bytes passes at line rate: RTT = a + 8 max(0, s - B) / r. Above B only the
    # intercept moves (to a - 8 B / r), so the slope still gives r exactly.
    r, burst = 8e6, 25_000
    sizes = [60_000, 100_000, 150_000, 200_000]
    fit = fit_sweep(sizes, [0.001 + 8 * max(0, s - burst) / r for s in sizes])
    assert fit.rate_bps == pytest.approx(r, rel=1e-9)
    assert fit.intercept_s == pytest.approx(0.001 - 8 * burst / r) and fit.r2 == pytest.approx(1.0)


def test_fit_refuses_what_cannot_give_a_slope():
    with pytest.raises(ValueError, match="1 distinct size"):
        fit_sweep([100, 100], [0.1, 0.2])
    with pytest.raises(ValueError, match="2 sizes but 1 round trips"):
        fit_sweep([1, 2], [0.1])
    with pytest.raises(ValueError, match="round trip -0.1"):
        fit_sweep([1, 2], [0.1, -0.1])
    flat = fit_sweep([1000, 2000], [0.002, 0.001])  # faster than the sizes resolve: no positive slope
    assert flat.rate_bps is None


def test_latency_stats_by_hand():
    st = latency_stats([0.001, 0.003, 0.002, 0.006])
    assert st["rtt_min_s"] == 0.001 and st["rtt_median_s"] == pytest.approx(0.0025) and st["rtt_p95_s"] == 0.006
    assert st["jitter_s"] == pytest.approx((0.002 + 0.001 + 0.004) / 3) and st["n"] == 4


def test_parse_endpoint():
    assert parse_endpoint("tcp://10.0.0.2:5700") == ("10.0.0.2", 5700)
    assert parse_endpoint("tcp://[::1]:80") == ("::1", 80)
    for bad in ("udp://h:1", "tcp://h", "tcp://h:0", "tcp://:5", "tcp://h:x", "tcp://h:65536"):
        with pytest.raises(ValueError, match="allowed: tcp://HOST:PORT"):
            parse_endpoint(bad)
    assert parse_endpoint("tcp://0.0.0.0:0", any_port=True) == ("0.0.0.0", 0)


# --- server and client over loopback ---------------------------------------------------------------------

@pytest.fixture
def server():
    srv = ProbeServer("tcp://127.0.0.1:0")
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{srv.port}"
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_ping_round_trips_and_a_stranger_is_dropped_without_harm(server):
    c = ProbeClient(server)
    try:
        assert 0 < c.ping(100_000, 1) < 5 and 0 < c.ping(0, 300_000) < 5
        with pytest.raises(ValueError, match="n_down=0"):
            c.ping(10, 0)
    finally:
        c.close()
    host, port = parse_endpoint(server)
    with socket.create_connection((host, port), timeout=5) as raw:  # not our protocol: the server hangs up
        raw.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        assert raw.recv(10) == b""
    with socket.create_connection((host, port), timeout=5) as raw:  # ours, but asking for too much
        raw.sendall(HEADER.pack(MAGIC, 1, ord("P"), 0, 2 ** 40))
        assert raw.recv(10) == b""
    c = ProbeClient(server)  # other clients are still served
    try:
        assert c.ping(10, 10) > 0
    finally:
        c.close()


def test_run_probe_on_loopback_returns_a_complete_json_result(server):
    res = run_probe(server, target_s=0.01, repeats=2, points=3, pings=5, max_bytes=2 ** 22, budget_s=3.0)
    json.dumps(res)  # JSON-ready
    assert res["latency"]["n"] == 5 and res["latency"]["rtt_min_s"] > 0
    for name in ("uplink", "downlink"):
        assert len(res[name]["all_sizes_bytes"]) == len(res[name]["rtts_s"]) >= 2
        assert res[name]["rate_bps"] is None or res[name]["rate_bps"] > 1e6  # loopback: fast or unresolved
    with pytest.raises(ValueError, match="directions"):
        run_probe(server, directions=("sideways",))


def test_cli_probe_serve_once_connect_and_save(tmp_path):
    srv = subprocess.Popen([sys.executable, "-m", "testbed.cli", "channel", "probe", "--serve",
                            "tcp://127.0.0.1:0", "--once"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stderr.readline()  # port 0: the system picks one, and the server says which
        assert "link probe server" in line, line
        port = int(line.split("(port ")[1].split(")")[0])
        out = tmp_path / "probe.json"
        rc = main(["channel", "probe", "--connect", f"tcp://127.0.0.1:{port}", "--direction", "up",
                   "--target-s", "0.01", "--repeats", "1", "--points", "3", "--pings", "3",
                   "--max-bytes", str(2 ** 21), "--budget-s", "2", "--out", str(out)])
        assert rc == 0
        saved = json.loads(out.read_text())
        assert saved["endpoint"] == f"tcp://127.0.0.1:{port}" and "uplink" in saved and "downlink" not in saved
        assert srv.wait(timeout=10) == 0  # --once: exits after the client leaves
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def test_cli_probe_errors_are_usage_errors(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert main(["channel", "probe", "--connect", f"tcp://127.0.0.1:{port}", "--timeout-s", "2"]) == 2
    assert "cannot connect" in capsys.readouterr().err
    assert main(["channel", "probe", "--connect", "http://x:1"]) == 2
    assert "allowed: tcp://HOST:PORT" in capsys.readouterr().err
    with pytest.raises(ProbeError, match="cannot connect"):
        ProbeClient(f"tcp://127.0.0.1:{port}", timeout_s=2)


# --- device-side SNR probes --------------------------------------------------------------------------------

def test_file_probe_reads_a_number_or_key_values_and_reports_failures(tmp_path):
    f = tmp_path / "snr"
    probe = make_probe(f"file:{f}")
    assert isinstance(probe, FileProbe)
    missing = probe.measure()
    assert not missing.ok and "cannot read" in missing.error and missing.source == f"file:{f}"
    f.write_text("17.5\n")
    m = probe.measure()
    assert m.ok and m.snr_db == 17.5 and m.t_wall == pytest.approx(f.stat().st_mtime) and m.error is None
    f.write_text("# written by my script\nsignal_dbm = -61\nnoise_dbm=-93\nt_wall=1700000000.5\n")
    m = probe.measure()
    assert (m.snr_db, m.signal_dbm, m.noise_dbm, m.t_wall) == (32.0, -61.0, -93.0, 1700000000.5)
    for bad in ("fast\n", "snr=3\n", "snr_db=\n", "signal_dbm=-60\n"):
        f.write_text(bad)
        m = probe.measure()
        assert not m.ok and m.error, bad


def test_command_probe_parses_output_and_survives_hangs_and_failures():
    ok = CommandProbe(f"{sys.executable} -c \"print('snr_db=12.25')\"").measure()
    assert ok.ok and ok.snr_db == 12.25 and abs(ok.t_wall - time.time()) < 5
    t0 = time.monotonic()
    hung = CommandProbe(f"{sys.executable} -c 'import time; time.sleep(30)'", timeout_s=0.3).measure()
    assert not hung.ok and "no answer within 0.3 s" in hung.error and time.monotonic() - t0 < 10
    failed = CommandProbe(f"{sys.executable} -c 'import sys; sys.exit(\"no link\")'").measure()
    assert not failed.ok and "exit status 1: no link" in failed.error
    absent = CommandProbe("/nonexistent/snr-tool").measure()
    assert not absent.ok and "cannot run" in absent.error
    with pytest.raises(ValueError, match="empty"):
        CommandProbe("  ")


PROC = ("Inter-| sta-|   Quality        |   Discarded packets\n"
        " face | tus | link level noise |  nwid  crypt   frag  retry   misc | beacon | 22\n"
        " wlan0: 0000   54.  -56.  {noise}.        0      0      0      0      0        0\n")
IW_LINK = ("Connected to 00:11:22:33:44:55 (on wlan0)\n\tSSID: lab\n\tfreq: 5180\n\tRX: 1 bytes\n"
           "\tsignal: -48 dBm\n\ttx bitrate: 433.3 MBit/s\n")
IW_SURVEY = ("Survey data from wlan0\n\tfrequency:\t\t\t5170 MHz\n\tnoise:\t\t\t\t-90 dBm\n"
             "Survey data from wlan0\n\tfrequency:\t\t\t5180 MHz [in use]\n\tnoise:\t\t\t\t-97 dBm\n"
             "\tchannel active time:\t\t100 ms\n")


def test_linux_wireless_probe_from_proc_and_from_iw(tmp_path):
    proc = tmp_path / "wireless"
    none = LinuxWirelessProbe("wlan0", proc_path=str(proc), iw=None).measure()
    assert not none.ok and "no signal level" in none.error
    proc.write_text(PROC.format(noise=-95))
    m = LinuxWirelessProbe(proc_path=str(proc), iw=None).measure()
    assert (m.snr_db, m.signal_dbm, m.noise_dbm) == (39.0, -56.0, -95.0) and str(proc) in m.source
    proc.write_text(PROC.format(noise=-256))  # the driver reports no noise: the floor, and the source says so
    m = LinuxWirelessProbe("wlan0", proc_path=str(proc), iw=None, noise_floor_dbm=-92.0).measure()
    assert m.snr_db == 36.0 and "noise assumed -92 dBm" in m.source
    assert not LinuxWirelessProbe("wlan9", proc_path=str(proc), iw=None).measure().ok
    # With iw: signal from `iw dev IFACE link`, noise of the channel in use from `iw dev IFACE survey dump`.
    iw = tmp_path / "iw"
    (tmp_path / "link.txt").write_text(IW_LINK)
    (tmp_path / "survey.txt").write_text(IW_SURVEY)
    iw.write_text(f"#!/bin/sh\nif [ \"$3\" = link ]; then cat {tmp_path}/link.txt; "
                  f"else cat {tmp_path}/survey.txt; fi\n")
    iw.chmod(iw.stat().st_mode | stat.S_IEXEC)
    m = LinuxWirelessProbe(proc_path=str(proc), iw=str(iw)).measure()  # interface found in /proc
    assert (m.snr_db, m.signal_dbm, m.noise_dbm) == (49.0, -48.0, -97.0) and "iw survey" in m.source
    assert parse_iw_link("Not connected.\n") is None and parse_iw_survey("Survey data from wlan0\n") is None


def test_make_probe_specs_none_and_background_sampling(tmp_path):
    for bad in ("wifi", "file:", "command:", "none:x"):
        with pytest.raises(ValueError, match="allowed: none, linux-wireless"):
            make_probe(bad)
    assert isinstance(make_probe(None), NoneProbe) and isinstance(make_probe("linux-wireless:wlan1"),
                                                                  LinuxWirelessProbe)
    empty = make_probe("none").measure()
    assert empty.snr_db is None and empty.error is None
    f = tmp_path / "snr"
    f.write_text("5")
    bg = BackgroundProbe(FileProbe(str(f)), period_s=0.02).start()
    try:
        assert wait_until(bg.latest, 5, "a first background reading").snr_db == 5.0
        f.write_text("6")
        wait_until(lambda: bg.latest().snr_db == 6.0, 5, "the background probe reading the new value")
    finally:
        bg.stop()


def test_a_probe_that_raises_still_returns_a_value():
    class Broken(FileProbe):
        def _measure(self):
            raise RuntimeError("driver exploded")

    m = Broken("/x").measure()
    assert not m.ok and m.error == "RuntimeError: driver exploded"


def test_a_device_measurement_drives_the_live_channel_state(tmp_path):
    f = tmp_path / "snr"
    f.write_text("snr_db=21\n")
    m = make_probe(f"file:{f}").measure()
    st = ChannelState.from_config({"source": "live", "live": {"max_age_s": 5.0}}, [{"name": "dev0"}])
    assert st.report_live("dev0", m.to_dict(), t_s=100.0 - m.age_s(now=m.t_wall + 1.0))  # 1 s old on arrival
    g = st.gains_db(0, 100.0)
    assert st.gain_to_snr_db("dev0", g["dev0"]) == pytest.approx(21.0)
    assert st.live_used("dev0")["age_s"] == pytest.approx(1.0) and st.live_used("dev0")["probe"] == f"file:{f}"
    assert not st.report_live("dev0", LinkMeasurement.failed("command:x", "timeout"))


def test_device_probes_use_only_the_standard_library():
    tree = ast.parse((ROOT / "device_node" / "link_probe.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in mods} <= set(sys.stdlib_module_names), mods
