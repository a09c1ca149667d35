"""Validate the emulator on real messages: achieved against configured air time over a real emulator process.

A sender (DEALER, routing_id ``sender``) and a receiver (the "edge": a ROUTER) live in this process; the
emulator runs as a separate process between them on ipc:// endpoints in a temporary directory. For each
(rate, size) the sender stamps t0 on this host's monotonic clock, sends the ``tx_start`` marker and the
payload; the receiver, busy-polling, stamps t1 when the whole message is in.
achieved = t1 - t0, modeled = 8 bytes / rate,
where bytes counts every frame the emulator charges (header + payload). The next message is sent only after
the previous one arrived, so no queueing enters. Error = achieved / modeled - 1.

Virtual mode holds nothing, so the time on this host's clock says nothing about air time: there the
measured value is the air time the emulator annotated (airtime + queueing + base latency), one message per
`configure` (a virtual round, whose queues start empty), and every cell is in scope. `exit_status` is 1 when
a cell in scope misses the target. The lead is calibrated on the sizes that are measured at some rate only,
and a grid whose every cell would be skipped is refused before anything runs.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from channel_emulator import DEFAULT_SPIN_S


def _percentile(xs: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), without numpy: the validator must run
    # wherever pyzmq runs.
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


TARGET_MEDIAN_ERROR = 0.01
TARGET_MIN_MODELED_S = 0.002
DEFAULT_SIZES = [100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000]
DEFAULT_RATES = [0.1e6, 1e6, 10e6, 100e6]


@dataclass
class Cell:
    size: int
    rate_bps: float
    modeled_s: float
    achieved_s: list[float] = field(default_factory=list)
    held_s: list[float] = field(default_factory=list)
    skipped: str | None = None
    mode: str = "real"
    annotated_s: list[float] = field(default_factory=list)  # airtime + queued + base latency, as annotated

    @property
    def measured_s(self) -> list[float]:
        """What is compared with the model: the time on this host's clock (real), or the annotated air time
        (virtual: nothing is held, so the clock would measure only the transport)."""
        return self.annotated_s if self.mode == "virtual" else self.achieved_s

    @property
    def errors(self) -> list[float]:
        return [a / self.modeled_s - 1.0 for a in self.measured_s]

    @property
    def in_target_scope(self) -> bool:
        # Below 2 ms the host's clock and wake-ups dominate a real hold; an annotation has no such floor.
        return self.mode == "virtual" or self.modeled_s >= TARGET_MIN_MODELED_S

    def summary(self) -> dict:
        out = {"size_bytes": self.size, "rate_bps": self.rate_bps, "modeled_s": self.modeled_s,
               "skipped": self.skipped, "mode": self.mode,
               "measure": "annotated air time" if self.mode == "virtual" else "wall clock, send to receive"}
        if self.skipped is None:
            e = self.errors
            scoped = self.in_target_scope
            out.update({
                "repeats": len(e),
                "achieved_median_s": median(self.achieved_s) if self.achieved_s else None,
                "annotated_median_s": median(self.annotated_s) if self.annotated_s else None,
                "median_error": median(e),
                "p95_abs_error": _percentile([abs(x) for x in e], 95),
                "emulator_held_median_s": median(self.held_s) if self.held_s else None,
                "in_target_scope": scoped,
                "meets_target": (abs(median(e)) <= TARGET_MEDIAN_ERROR) if scoped else None,
            })
        return out


def start_emulator(workdir: Path, mode: str = "real", spin_s: float = DEFAULT_SPIN_S) -> tuple[subprocess.Popen, dict]:
    from testbed.runtime.processes import child_preexec

    eps = {"frontend": f"ipc://{workdir}/chan-front", "edge": f"ipc://{workdir}/chan-edge",
           "control": f"ipc://{workdir}/chan-ctl"}
    # A terminal's Ctrl-C goes to the whole process group: the emulator leaves it to us, so that we stop it
    # in order (as `multispin run` does its children) instead of finding it dead. Its log goes to a file: a
    # pipe that nobody reads would stop the emulator at its first 64 KiB of log lines.
    with open(workdir / "emulator.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "channel_emulator.proxy", "--frontend", eps["frontend"],
                                 "--edge", eps["edge"], "--control", eps["control"], "--mode", mode,
                                 "--spin-s", str(spin_s)],
                                stdout=subprocess.DEVNULL, stderr=log, preexec_fn=child_preexec(),
                                cwd=str(Path(__file__).resolve().parent.parent))
    return proc, eps


def stop_emulator(proc: subprocess.Popen, control, interrupted: bool = False) -> None:
    """Ask the emulator to stop; after an interruption (it may still be starting, and holds nothing worth
    a goodbye) end it by its handle at once, so that Ctrl-C never waits on its start-up."""
    if control is not None and not interrupted and proc.poll() is None:
        try:
            control.stop()
        except (TimeoutError, RuntimeError):
            pass
    if interrupted:
        proc.terminate()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class _Bench:
    """The sender and the receiver of the validation, with the emulator process between them."""

    def __init__(self, tmp: Path, mode: str, spin_s: float, spin_receive: bool = True):
        import zmq

        self.spin_receive = spin_receive
        from channel_emulator.proxy import ChannelControl
        from testbed.runtime.processes import how_it_exited, signals_held
        from testbed.wire.protocol import encode_header, tx_start_marker

        self.encode_header = encode_header
        self.ctx = zmq.Context()
        self.proc, self.control, self.edge, self.sender = None, None, None, None
        try:  # Ctrl-C may come at any step: whatever was made so far is undone by close()
            with signals_held():
                self.proc, eps = start_emulator(tmp, mode=mode, spin_s=spin_s)
            self.control = ChannelControl(eps["control"], timeout_s=10.0, context=self.ctx,
                                          gone=lambda: how_it_exited(self.proc))
            self.edge = self.ctx.socket(zmq.ROUTER)
            self.edge.setsockopt(zmq.LINGER, 0)
            self.edge.bind(eps["edge"])
            self.sender = self.ctx.socket(zmq.DEALER)
            self.sender.setsockopt(zmq.ROUTING_ID, b"sender")
            self.sender.setsockopt(zmq.LINGER, 0)
            self.sender.connect(eps["frontend"])
            self.control.stats()  # waits until the emulator is up
            # Warm-up: the first message through opens the emulator's DEALER towards the edge.
            self.sender.send_multipart([encode_header({"type": "hello"})])
            if not self.edge.poll(10_000):
                raise RuntimeError(f"the channel emulator forwarded nothing within 10 s "
                                   f"({how_it_exited(self.proc) or 'still running'})")
            self.edge.recv_multipart()
        except BaseException:
            self.close(interrupted=True)
            raise
        self.marker = tx_start_marker("ul")

    def header(self) -> bytes:
        return self.encode_header({"type": "payload", "air": "ul", "seq": 0})  # same length every time

    def send_one(self, payload: bytes, use_marker: bool = True) -> tuple[float, dict]:
        """Send one charged message; returns (achieved seconds on this host's clock, channel annotation)."""
        from testbed.wire.protocol import decode_header

        header = self.header()
        t0 = time.monotonic()
        if use_marker:
            self.sender.send(self.marker)
        self.sender.send_multipart([header, payload], copy=False)
        if self.spin_receive:
            # Busy-poll: times the emulator, not this VM's thread wake-up (0.1-1 ms of jitter on 2 cores).
            while not self.edge.poll(0):
                pass
        frames = self.edge.recv_multipart(copy=False)
        t1 = time.monotonic()
        return t1 - t0, decode_header(frames[1].bytes)["channel"]

    def close(self, interrupted: bool = False) -> None:
        """Stop the emulator and free every socket; never blocks (a Ctrl-C mid-set-up leaves parts unset)."""
        try:
            if self.proc is not None:
                stop_emulator(self.proc, self.control, interrupted)
        finally:
            self.ctx.destroy(linger=0)  # closes every socket made on it, the control's rebuilt ones included


def calibrate_lead(bench: _Bench, sizes, repeats: int, hold_s: float = 0.02) -> dict:
    """Transport time outside the emulator's hold: the marker's hop in, the payload's hop out and the wake-ups
    of sleeping threads. Measured with lead 0 on messages held ``hold_s`` (so the threads are as idle as in a
    real hold; a message forwarded at once under-estimates the wake-ups), separately from the validation
    samples. Fit lead = a + b * bytes through the smallest and the largest size."""
    med = {}
    for size in sorted({int(s) for s in sizes}):
        payload = bytes(size)
        nbytes = len(bench.header()) + size
        rate = 8.0 * nbytes / hold_s
        bench.control.configure(round=-1, links={"sender": {"ul_rate_bps": rate}})
        med[nbytes] = float(median([bench.send_one(payload)[0] - hold_s for _ in range(max(3, repeats))]))
    small, large = min(med), max(med)
    a = max(0.0, med[small])
    b = max(0.0, (med[large] - a) / (large - small)) if large > small else 0.0
    return {"lead_s": a, "lead_per_byte_s": b, "calibration_hold_s": hold_s,
            "transport_median_s": {str(k): v for k, v in med.items()}}


def repeats_for(modeled_s: float, repeats: int | None) -> int:
    # Short cells are cheap and the noisiest (scheduler spikes of 1-10 ms on a shared VM): more samples.
    if repeats is not None:
        return repeats
    return 21 if modeled_s < 0.1 else 5


def _header_bytes() -> int:
    from testbed.wire.protocol import encode_header

    return len(encode_header({"type": "payload", "air": "ul", "seq": 0}))  # what `_Bench.header` sends


def measured_sizes(sizes, rates, max_modeled_s: float) -> list[int]:
    """The sizes with at least one cell at or below `max_modeled_s` (the lead is calibrated on those only: a
    size skipped at every rate is shown as skipped, never calibrated for). ValueError when no size has one:
    every cell would be skipped, and nothing would be validated ("0/0 cells")."""
    h = _header_bytes()
    out = [int(size) for size in sizes if 8.0 * (h + int(size)) / max(rates) <= max_modeled_s]
    if not out:
        raise ValueError(f"--sizes: {', '.join(str(int(s)) for s in sizes)} bytes would take more than "
                         f"--max-modeled-s {max_modeled_s:g} s at every rate (the fastest, {max(rates):g} bit/s): "
                         f"nothing to validate; raise --max-modeled-s or --rates, or use smaller sizes")
    return out


def exit_status(cells: list[Cell]) -> int:
    """0 when every measured cell in scope meets the target (|median error| <= 1%), else 1."""
    scoped = [c.summary() for c in cells if not c.skipped and c.in_target_scope]
    return 0 if scoped and all(s["meets_target"] for s in scoped) else 1


def run_validation(sizes=DEFAULT_SIZES, rates=DEFAULT_RATES, repeats: int | None = None, mode: str = "real",
                   max_modeled_s: float = 3.0, spin_s: float = DEFAULT_SPIN_S, use_marker: bool = True,
                   lead: str | tuple[float, float] = "auto", progress=None) -> tuple[list[Cell], dict]:
    """Returns the cells and the lead used (``lead="auto"``: calibrated first; ``(a, b)``: given; virtual
    mode: none, nothing is held). ValueError on a bad argument, before anything runs."""
    if repeats is not None and repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid; allowed: an integer >= 1 (or None: 21 below 0.1 s, else 5)")
    if mode not in ("real", "virtual"):
        raise ValueError(f"mode={mode!r} is invalid; allowed: real, virtual")
    measured = measured_sizes(sizes, rates, max_modeled_s)
    with tempfile.TemporaryDirectory(prefix="multispin-chan-") as tmp:
        bench = _Bench(Path(tmp), mode, spin_s)
        cells: list[Cell] = []
        try:
            if mode == "virtual":
                lead_info = {"lead_s": 0.0, "lead_per_byte_s": 0.0}  # a virtual message is never held
            elif lead == "auto":
                bench.control.configure(round=-1, links={}, mode="real")
                # Only sizes that are measured: a size skipped at every rate needs no lead.
                lead_info = calibrate_lead(bench, measured, max(repeats or 0, 21))
            else:
                lead_info = {"lead_s": float(lead[0]), "lead_per_byte_s": float(lead[1])}
            bench.control.configure(round=-1, links={}, mode=mode)
            plan = [(r, s) for r in rates for s in sizes]
            for i, (rate, size) in enumerate(plan):
                modeled = 8.0 * (len(bench.header()) + size) / rate
                cell = Cell(int(size), float(rate), modeled, mode=mode)
                cells.append(cell)
                if modeled > max_modeled_s:
                    cell.skipped = f"modeled {modeled:.3g} s > {max_modeled_s} s"
                else:
                    links = {"sender": {"ul_rate_bps": rate, "dl_rate_bps": rate}}
                    payload = random.Random(i).randbytes(int(size))
                    for k in range(repeats_for(modeled, repeats)):
                        if k == 0 or mode == "virtual":  # virtual: one message per round, from empty queues
                            bench.control.configure(round=i, links=links, lead_s=lead_info["lead_s"],
                                                    lead_per_byte_s=lead_info["lead_per_byte_s"])
                        achieved, info = bench.send_one(payload, use_marker)
                        cell.achieved_s.append(achieved)
                        cell.held_s.append(info["held_s"])
                        cell.annotated_s.append(info["airtime_s"] + info["queued_s"] + info["base_latency_s"])
                if progress:
                    progress(i + 1, len(plan), cell)
        except BaseException:
            bench.close(interrupted=True)
            raise
        bench.close()
    return cells, lead_info


def format_table(cells: list[Cell]) -> str:
    virtual = any(c.mode == "virtual" for c in cells)
    measured = "annotated s" if virtual else "achieved s"
    lines = [f"{'size B':>9} {'rate Mbit/s':>11} {'modeled s':>10} {measured:>11} {'median err':>10} "
             f"{'p95 |err|':>9}  target"]
    for c in cells:
        head = f"{c.size:>9} {c.rate_bps / 1e6:>11g} {c.modeled_s:>10.4g}"
        if c.skipped:
            lines.append(f"{head} {'':>11} {'':>10} {'':>9}  skipped ({c.skipped})")
            continue
        s = c.summary()
        verdict = ("ok" if s["meets_target"] else "MISSED") if s["in_target_scope"] else "n/a (< 2 ms)"
        lines.append(f"{head} {median(c.measured_s):>11.4g} {100 * s['median_error']:>9.3f}% "
                     f"{100 * s['p95_abs_error']:>8.3f}%  {verdict}")
    scoped = [c.summary() for c in cells if not c.skipped and c.in_target_scope]
    met = sum(1 for s in scoped if s["meets_target"])
    where = ("every measured cell (virtual: the annotated air time against 8 x bytes / rate; nothing is held, "
             "so the wall clock is not compared)" if virtual
             else f"where modeled >= {1000 * TARGET_MIN_MODELED_S:g} ms")
    lines.append(f"target |median error| <= {100 * TARGET_MEDIAN_ERROR:g}% {where}: {met}/{len(scoped)} cells "
                 f"meet it")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cells, lead = run_validation(progress=lambda i, n, c: print(f"[{i}/{n}]", file=sys.stderr))
    print(lead)
    print(format_table(cells))
