"""Probe sweeps of a real link (`channel.measure_links` with `channel.rate_probes`): the edge measures each
device's UL and DL rate by size-swept ping-pong over the session's own socket, with no clock compared across
hosts.

A `probe` (edge -> device) carries n bytes of padding and asks for m bytes back; the device answers at once
with a `probe_echo` that says how long it held the probe (`hold_s`, a duration on its own clock). On the
edge's clock, round trip - hold = a + 8 n / r_DL + 8 m / r_UL, so

- a DL sweep (n grows, m = 0) has the slope 1 / r_DL,
- a UL sweep (n = 0, m grows) has the slope 1 / r_UL,

each with its own intercept a (latencies, the small message, the edge's and the device's handling), which is
why these samples go into their own fit (`LinkEstimator.set_probe`), never into the rounds' (whose intercept
is a schedule's and a draft's trip). A sweep grows the size from `min_bytes` (x2..x16 by the shortfall, as
`multispin channel probe` does) until a round trip takes `target_s` or the size reaches `max_bytes`, then
probes POINTS sizes from a quarter of that size to it, REPEATS times in shuffled order (up to MAX_REPEATS
while the fit cannot tell), all within `budget_s`; `fit_line` goes through the repeats' per-size minima
(through the large ones alone when they spread, so that a shaper's burst shifts the intercept, not the
slope), and a sweep claims its rate only when the line is tight enough (`accepted`). A pause of GAP_S
between probes lets a token bucket (tc tbf, a Wi-Fi burst) refill, so that each probe meets the same bucket.

When (`Prober`): at a device's registration, a sweep of each direction, before the next round. Between
rounds, the refresh of at most one device (`due`): a direction measured (by a sweep or by a large message of
the rounds) longer ago than `every_s`, or, first, one whose other direction's rate moved by CHANGE_FACTOR
since it was last measured (a link that changed one way is suspect the other way); when that sweep moves
its own direction's rate by CHANGE_FACTOR, the device's other direction is swept in the same gap. Age
refreshes take at most `max_time_share` of the time (every sweep's time counts); a change is swept in the
next gap whatever the share, as each needs a new move of CHANGE_FACTOR. Sweeps run only between rounds, so
no round's messages share the link with them; the edge serves every other message meanwhile
(`EdgeServer.poll`). The plan uses the more recent of the rounds' fit and the latest sweep's (`LinkEstimator.choose`).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from testbed.core.vocabulary import DOWNLINK, UPLINK
from testbed.runtime.link_estimate import DirectionEstimate, LinkFit, next_sweep_size
from testbed.wire import messages as M
from testbed.wire import protocol as P

log = logging.getLogger("multispin.edge.probing")

DIRECTIONS = (DOWNLINK, UPLINK)  # a registration sweeps both, the downlink first (the edge's own egress)
POINTS = 3              # sizes from a quarter of the largest to it, after the growth
REPEATS = 2             # ... each probed this many times: the minimum drops one-sided delays
MAX_REPEATS = 6         # ... or up to this many while the fit cannot tell yet (a fast link), within the budget
GROW_SHARE = 0.5        # the growth may use this share of the budget; the repeats the rest
GAP_S = 0.01            # between probes: a 3-10 kB token bucket refills at 4-20 Mbit/s within 6 ms
MIN_ECHO_WAIT_S = 2.0   # an echo later than this (or than the budget, if longer) ends the sweep
CHANGE_FACTOR = 1.3     # the other direction's rate moved this much (either way): re-probe this one
SWEEP_WINDOW = 64       # samples a sweep's fit keeps (a sweep makes about 10-20)
MIN_GROUPS = 3          # a sweep's line goes through this many sizes at least (two always fit exactly)
RESID_SHARE = 0.05      # ... and scatters around it by at most this share of the largest transfer's time
RESID_FLOOR_S = 0.001   # ... or this (a fast link's transfers are as short as the host's jitter)


def _other(direction: str) -> str:
    return "ul" if direction == DOWNLINK else "dl"


def _moved(ref: float | None, rate: float | None) -> bool:
    """Whether a rate moved by CHANGE_FACTOR or more (either way) from `ref` (False when either is None)."""
    return ref is not None and rate is not None and max(rate / ref, ref / rate) >= CHANGE_FACTOR


def accepted(est: DirectionEstimate) -> tuple[LinkFit | None, str | None]:
    """A sweep's fit, held to more than a rounds fit (`fit_line`): through at least MIN_GROUPS sizes, and
    within RESID_SHARE of the largest transfer's time (or RESID_FLOOR_S): a loss that TCP retransmits after
    its timeout (200 ms or more) holds one size's probes and must not tilt the line; (None, why) else."""
    fit = est.fit
    if fit is None:
        return None, None
    transfer = 8.0 * max(b for b, _ in est.samples) / fit.rate_bps
    if fit.groups < MIN_GROUPS:
        return None, f"no rate: {fit.groups} sizes (at least {MIN_GROUPS} needed)"
    if fit.resid_rms_s > max(RESID_FLOOR_S, RESID_SHARE * transfer):
        return None, (f"no rate: the round trips scatter by {1e3 * fit.resid_rms_s:.1f} ms around the line, against "
                      f"a {1e3 * transfer:.1f} ms transfer (losses or delays on the path)")
    return fit, None


@dataclass
class Sweep:
    """One direction of one device to measure, and why ("registration", "age", "change")."""

    name: str
    direction: str
    why: str
    sid: str = ""  # the session it was asked for: a device that re-registered meanwhile gets its own


@dataclass
class _Pending:
    name: str
    id: int
    reply_bytes: int
    t_send: float
    rtt: float | None = None
    error: str | None = None


@dataclass
class SweepSizes:
    """The sizes of one sweep (pure: no clock; the caller says how much time is left)."""

    min_bytes: int
    max_bytes: int
    target_s: float
    seed: int = 0

    def next_growth(self, size: int, rtt_s: float) -> int | None:
        """The size after `size` took `rtt_s`, or None when the growth is over (target or max reached)."""
        return next_sweep_size(size, rtt_s, self.target_s, self.max_bytes)

    def repeats(self, top: int, passes: int = REPEATS) -> list[list[int]]:
        """The sizes probed after the growth: POINTS from top / 4 to top, `passes` times, shuffled per pass."""
        # rounded up: the smallest stays among the "large" sizes `fit_line` keeps (>= a quarter of the largest)
        sizes = sorted({max(1, math.ceil(top * (0.25 + 0.75 * i / (POINTS - 1)))) for i in range(POINTS)})
        rng, out = random.Random(self.seed), []
        for _ in range(passes):
            order = sizes[:]
            rng.shuffle(order)
            out.append(order)
        return out


class Prober:
    """Runs the probe sweeps of an `EdgeServer` (`server`: its sessions, `send`, `poll`, `links`, and
    `publish_link_rates`); `settings`: `testbed.run.profile.RateProbeSettings`."""

    def __init__(self, server, settings):
        self.server, self.settings = server, settings
        self.queue: deque[Sweep] = deque()       # registration sweeps, run before the next round
        self._ids = itertools.count()
        self._pending: _Pending | None = None
        self._zeros: np.ndarray | None = None     # the downlink's padding, allocated once
        self.tried: dict[tuple[str, str], float] = {}   # (name, direction) -> the latest sweep's end
        # (name, direction) -> the other direction's rate when this one was last measured (the change trigger)
        self.ref: dict[tuple[str, str], float | None] = {}
        self.done: list[dict] = []                 # sweeps since the last round record (`take_log`)
        self.refresh_from = -math.inf              # no refresh sweep before this (edge clock)
        self.seen: dict[tuple[str, str], float | None] = {}  # (name, direction) -> its last measurement seen

    # -- hooks of the edge ---------------------------------------------------------------------------
    def on_register(self, name: str, sid: str) -> None:
        """A session opened: sweep both of its directions before its first round."""
        for q in [s for s in self.queue if s.name == name]:
            self.queue.remove(q)
        self.queue.extend(Sweep(name, d, "registration", sid) for d in DIRECTIONS)

    def on_echo(self, name: str, header: dict, arrays: dict, t_arr: float) -> None:
        """A `probe_echo`: the round trip of the probe awaited (an echo of an abandoned probe is ignored)."""
        echo = M.parse_probe_echo(header, arrays)
        p = self._pending
        if p is None or p.name != name or echo.id != p.id or p.rtt is not None or p.error is not None:
            log.debug("%s: ignoring the echo of probe %d (not awaited)", name, echo.id)
            return
        if echo.pad_bytes != p.reply_bytes:
            p.error = f"probe_echo.pad: {echo.pad_bytes} bytes, the probe asked for {p.reply_bytes}"
            raise P.ProtocolError(p.error)
        rtt = t_arr - p.t_send - echo.hold_s
        if rtt <= 0:
            p.error = f"probe_echo.hold_s: {echo.hold_s:g} s is longer than the round trip {t_arr - p.t_send:g} s"
            raise P.ProtocolError(p.error)
        p.rtt = rtt

    def run_registration(self, name: str) -> bool:
        """Asynchronous rounds (no gap between rounds): the registration sweeps queued for this device alone,
        before its first cycle; returns whether any ran. Refreshes need a gap and are not run there."""
        mine = [sw for sw in self.queue if sw.name == name]
        for sw in mine:
            self.queue.remove(sw)
            if self._session_ok(sw):
                self.run_sweep(sw)
        return bool(mine)

    def between_rounds(self) -> bool:
        """Run the registration sweeps queued, then the refresh of at most one device; returns whether any
        sweep ran (the plan made ahead is then stale)."""
        ran = False
        while self.queue:
            sw = self.queue.popleft()
            if self._session_ok(sw):
                self.run_sweep(sw)
                ran = True
        now = time.monotonic()
        self._track()
        # A change is evidence and is swept at once; only the age refreshes wait for the time share (a change
        # sweep made early in a run held the next one back for 19x its time, past the change it was for).
        sw = self.due(now, by_age=now >= self.refresh_from)
        if sw is None:
            return ran
        links, other = self.server.links, _other(sw.direction)
        before = links.choose(sw.name, sw.direction)[0]
        spent = self.run_sweep(sw)["s"]
        after = links.choose(sw.name, sw.direction)[0]
        if _moved(before, after) and self._session_ok(sw):
            # This direction changed: the other one of the same device is suspect at once (the plan may move
            # the device to the mode that loads only this one, and never measure the other again).
            spent += self.run_sweep(Sweep(sw.name, other, "change", sw.sid))["s"]
        # The refreshes' share of the time stays within max_time_share: after s seconds of sweeps, the next
        # refresh waits s (1 / share - 1).
        self.refresh_from = time.monotonic() + spent * (1.0 / self.settings.max_time_share - 1.0)
        return True

    def take_log(self) -> list[dict]:
        """The sweeps since the previous call (for the next round record)."""
        out, self.done = self.done, []
        return out

    # -- which direction next ------------------------------------------------------------------------
    def _track(self) -> None:
        """The change trigger's reference: for each direction measured since the previous gap (a sweep, or
        a large message of the rounds), the other direction's rate now."""
        links = self.server.links
        for name in self.server.sessions:
            for d in DIRECTIONS:
                key, t = (name, d), links.last_measured(name, d)
                if t != self.seen.get(key) or self.ref.get(key) is None:
                    self.seen[key], self.ref[key] = t, links.choose(name, _other(d))[0]

    def due(self, now: float, by_age: bool = True) -> Sweep | None:
        """The one direction to refresh in this gap, or None: one whose other direction's rate moved by
        CHANGE_FACTOR since it was last measured ("change", first), else (when `by_age`) the one measured
        longest ago beyond `every_s` ("age"; by the rounds' large messages, a sweep, or a sweep that could
        not tell)."""
        every = self.settings.every_s if by_age else None
        links, best, best_key = self.server.links, None, None
        for name in sorted(self.server.sessions):
            s = self.server.sessions[name]
            if s.done:
                continue
            for d in DIRECTIONS:
                times = [t for t in (links.last_measured(name, d), self.tried.get((name, d))) if t is not None]
                last = max(times, default=None)
                changed = _moved(self.ref.get((name, d)), links.choose(name, _other(d))[0])
                old = every is not None and (last is None or now - last > every)
                if not (changed or old):
                    continue
                key = (changed, math.inf if last is None else now - last)
                if best_key is None or key > best_key:
                    best, best_key = Sweep(name, d, "change" if changed else "age", s.sid), key
        return best

    # -- one sweep -----------------------------------------------------------------------------------
    def _session_ok(self, sw: Sweep) -> bool:
        s = self.server.sessions.get(sw.name)
        return s is not None and not s.done and (not sw.sid or s.sid == sw.sid)

    def run_sweep(self, sw: Sweep) -> dict:
        """Probe one direction of one device (serving every other message meanwhile); publish the fit and
        return the sweep's entry for the round record."""
        st = self.settings
        sizes = SweepSizes(st.min_bytes, st.max_bytes, st.target_s, seed=next(self._ids))
        grown, est = DirectionEstimate(window=SWEEP_WINDOW), DirectionEstimate(window=SWEEP_WINDOW)
        t0 = time.monotonic()
        pings, size = 0, st.min_bytes
        while True:  # the growth
            rtt, error = self._ping(sw, size)
            if error is not None:
                break
            pings += 1
            grown.add(size, rtt, t=time.monotonic())
            nxt = sizes.next_growth(size, rtt)
            # ... until the target, max_bytes, or a next size whose time (this one's, scaled) would overrun
            # the growth's share of the budget
            if nxt is None or time.monotonic() + rtt * nxt / size > t0 + GROW_SHARE * st.budget_s:
                break
            size = nxt
            self._gap()
        top = size
        # A repeat's time: the large growth steps' least time per byte (a loss on one of them only adds).
        per_byte = min([t / b for b, t in grown.samples if b >= top / 4], default=0.0)
        # The repeats, as far as the budget holds them: REPEATS passes, more while the fit cannot tell.
        for k, order in enumerate(sizes.repeats(top, MAX_REPEATS) if error is None else []):
            if k >= REPEATS and accepted(est)[0] is not None:
                break
            for s in order:
                if time.monotonic() + GAP_S + per_byte * s > t0 + st.budget_s:
                    continue
                self._gap()
                rtt, error = self._ping(sw, s)
                if error is not None:
                    break
                pings += 1
                est.add(s, rtt, t=time.monotonic())
            if error is not None:
                break
        # The fit stands on the repeats: a growth step is the first transfer of its size, which TCP may send
        # with a window not yet open (slow start on a path whose queue inflates the round trip): seen +3 ms
        # on 93 kB at 8 Mbit/s, +2.3% on the rate. The growth's samples serve only when the repeats tell nothing.
        fit, why = accepted(est)
        if fit is None and error is None:
            for (b, t), when in zip(grown.samples, grown.times):
                est.add(b, t, t=when)
            fit, why_all = accepted(est)
            why = why or why_all
        if fit is None and error is None:
            if why is None and len(est.samples) < 4:
                why = f"no rate: {len(est.samples)} probes within the budget ({st.budget_s:g} s)"
            elif why is None and top >= st.max_bytes and top * per_byte < st.target_s:
                why = f"no rate: the link is too fast for probes of {top} bytes (rate_probes.max_bytes)"
            error = why or ("no rate: the round trips did not grow with the size beyond their scatter (losses or "
                            "delays on the path)")
        return self._finish(sw, fit, t0, pings, error, top)

    def _finish(self, sw: Sweep, fit: LinkFit | None, t0: float, pings: int, error: str | None,
                top: int) -> dict:
        now = time.monotonic()
        links = self.server.links
        links.set_probe(sw.name, sw.direction, fit, now)
        self.tried[(sw.name, sw.direction)] = now
        self.server.publish_link_rates([sw.name])
        key = (sw.name, sw.direction)
        self.seen[key], self.ref[key] = links.last_measured(*key), links.choose(sw.name, _other(sw.direction))[0]
        entry = {"device": sw.name, "direction": sw.direction, "why": sw.why, "s": now - t0, "pings": pings,
                 "max_bytes": top, "fit": None if fit is None else fit.to_dict(), "error": error}
        self.done.append(entry)
        rate = "no rate" if fit is None else f"{fit.rate_bps / 1e6:.3f} Mbit/s"
        log.info("%s: %s probe sweep (%s): %s, %d probes up to %d bytes in %.3f s%s", sw.name,
                 sw.direction.upper(), sw.why, rate, pings, top, now - t0, f" ({error})" if error else "")
        return entry

    def _ping(self, sw: Sweep, size: int) -> tuple[float | None, str | None]:
        """One probe of `size` bytes in the sweep's direction; (round trip minus the device's hold, None) or
        (None, why it failed)."""
        srv = self.server
        if not self._session_ok(sw):
            return None, "the session ended"
        if sw.direction == DOWNLINK:  # n bytes down, nothing back
            if self._zeros is None or self._zeros.size < size:
                self._zeros = np.zeros(max(size, self.settings.max_bytes), np.uint8)
            p = _Pending(sw.name, next(self._ids), 0, 0.0)
            frames = M.probe(p.id, 0, self._zeros[:size])
        else:  # a bare probe down, n bytes back
            p = _Pending(sw.name, next(self._ids), size, 0.0)
            frames = M.probe(p.id, size)
        self._pending = p
        wait = max(MIN_ECHO_WAIT_S, self.settings.budget_s)
        p.t_send = time.monotonic()
        srv.send(sw.name, frames)
        srv.poll(p.t_send + wait, stop=lambda: p.rtt is not None or p.error is not None or not self._session_ok(sw))
        self._pending = None
        log.debug("%s: %s probe %d of %d bytes: %s", sw.name, sw.direction, p.id, size,
                  p.error or ("no echo" if p.rtt is None else f"{1e3 * p.rtt:.3f} ms"))
        if p.error is not None:
            return None, p.error
        if p.rtt is None:
            return None, (f"no echo within {wait:g} s" if self._session_ok(sw) else "the session ended")
        return p.rtt, None

    def _gap(self) -> None:
        self.server.poll(time.monotonic() + GAP_S)
