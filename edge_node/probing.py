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
probes POINTS sizes from a quarter of that size (at most the size of a target_s round trip) to it, and
`min_bytes`, in whole passes: REPEATS, up to MAX_REPEATS while the fit cannot tell or a size's two fastest
probes disagree (`settled`), all within `budget_s`; `fit_line` goes through the repeats' per-size minima
(through the large ones alone when they spread, so that a shaper's burst shifts the intercept, not the
slope), and a sweep claims its rate only when the line is tight enough (`accepted`). The small size gives
the shaper's burst (`burst_of`), which the rounds' fits account for. A pause of GAP_S between probes lets a
token bucket (tc tbf, a Wi-Fi burst) refill, so that each probe meets the same bucket. A probe during which
the edge's loop or ZeroMQ's I/O thread waited for a core (`edge_node.run_delay`) is set aside: it extends
the budget by its time (up to `budget_s` again) and serves only if the sweep cannot tell without it.

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

import dataclasses
import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from edge_node.run_delay import RunDelay
from testbed.core.vocabulary import DOWNLINK, UPLINK
from testbed.runtime.link_estimate import (
    LARGE_FRACTION,
    DirectionEstimate,
    LinkFit,
    burst_of,
    next_sweep_size,
    small_point,
)
from testbed.wire import messages as M
from testbed.wire import protocol as P

log = logging.getLogger("multispin.edge.probing")

DIRECTIONS = (DOWNLINK, UPLINK)  # a registration sweeps both, the downlink first (the edge's own egress)
POINTS = 3              # sizes from a quarter of the largest to it, after the growth
REPEATS = 2             # ... each probed this many times: the minimum drops one-sided delays
MAX_REPEATS = 8         # ... or up to this many while the fit cannot tell or is not `settled`, within the budget
AGREE_SHARE = 0.01      # `settled`: a size's two fastest probes within this share of its time ...
AGREE_FLOOR_S = 0.0005  # ... or this
DESCHEDULED_SHARE = 0.05  # a probe during which the edge waited for a core this share of its round trip ...
DESCHEDULED_FLOOR_S = 0.001  # ... and this (on a loaded host every probe waits a little), is set aside
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


def settled(est: DirectionEstimate) -> bool:
    """Whether each size's two fastest probes agree within AGREE_SHARE of their
    time (or AGREE_FLOOR_S): the least time of a size is then the link's, not one lucky probe's."""
    groups: dict[int, list[float]] = {}
    for b, t in est.samples:
        groups.setdefault(b, []).append(t)
    for times in groups.values():
        fast = sorted(times)
        if len(fast) < 2 or fast[1] - fast[0] > max(AGREE_FLOOR_S, AGREE_SHARE * fast[0]):
            return False
    return True


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
    `publish_link_rates`); `settings`: `testbed.run.profile.RateProbeSettings`; `run_delay`: whose waits for a
    core set a probe aside (default: this process's loop and ZeroMQ I/O threads)."""

    def __init__(self, server, settings, run_delay: RunDelay | None = None):
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
        self._run_delay = run_delay or RunDelay()  # the edge's threads waiting for a core (`_ping`)
        self._pings = 0                            # the current sweep's probes timed ...
        self._spoiled: list[tuple[int, float, float]] = []  # ... those the edge waited through, (bytes, s, when)
        self._spoiled_used = False                 # ... and whether the fit needed them after all

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
        # Per size, the fastest of the whole sweep (one measurement: no change of rate to follow within it).
        grown, est = (DirectionEstimate(window=SWEEP_WINDOW, recent=SWEEP_WINDOW) for _ in range(2))
        t0 = time.monotonic()
        self._pings, self._spoiled, self._spoiled_used = 0, [], False
        top, error = self._grow(sw, sizes, grown, t0)
        # A repeat's time: the large growth steps' least time per byte (a loss on one of them only adds).
        per_byte = min([t / b for b, t in grown.samples if b >= top / 4], default=0.0)
        if per_byte > 0:
            # The repeats go up to the size of a target_s round trip, or half the largest: the growth's last
            # step overshoots the target by up to 2x, and whole passes of that did not fit the budget twice at
            # 6 Mbit/s (halving at most: a step held by a loss would shrink the sizes into a shaper's burst).
            top = max(st.min_bytes, top // 2, min(top, int(st.target_s / per_byte)))
        if error is None:
            error = self._repeat(sw, sizes, top, per_byte, est, t0)
        if accepted(est)[0] is None and error is None and self._spoiled:
            # Every size needs its probes: on a host this loaded, those the edge waited through serve too.
            for b, t, when in self._spoiled:
                est.add(b, t, t=when)
            self._spoiled_used = True
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
        if fit is not None:  # the token bucket's burst, for the rounds' fits (`LinkEstimator.burst`)
            samples = list(est.samples)
            small_bytes, small_s = small_point(samples, fit)
            fit = dataclasses.replace(fit, burst_bytes=burst_of(samples, fit), small_bytes=small_bytes, small_s=small_s)
        return self._finish(sw, fit, t0, self._pings, error, top)

    def _grow(self, sw: Sweep, sizes: SweepSizes, grown: DirectionEstimate, t0: float) -> tuple[int, str | None]:
        """The growth: sizes from `min_bytes` until the target, max_bytes, or a next size whose time (this one's,
        scaled) would overrun the growth's share of the budget; returns (the last size, why a probe failed)."""
        size = self.settings.min_bytes
        while True:
            rtt, error = self._ping(sw, size)
            if error is not None:
                return size, error
            if rtt is None:  # set aside (the edge was descheduled): this size again, within the growth's share
                if time.monotonic() > t0 + GROW_SHARE * self._budget_s():
                    return size, None
                self._gap()
                continue
            grown.add(size, rtt, t=time.monotonic())
            nxt = sizes.next_growth(size, rtt)
            if nxt is None or time.monotonic() + rtt * nxt / size > t0 + GROW_SHARE * self._budget_s():
                return size, None
            size = nxt
            self._gap()

    def _repeat(self, sw: Sweep, sizes: SweepSizes, top: int, per_byte: float, est: DirectionEstimate,
                t0: float) -> str | None:
        """The repeats after the growth, whole passes as far as the budget holds them: REPEATS passes, more (up to
        MAX_REPEATS) until the fit tells and each size's two fastest probes agree (`settled`: on a busy host
        one clean probe per size is luck, two that agree are the link). Each pass also probes `min_bytes`,
        below a token bucket's burst, so that the sweep measures the burst (`burst_of`). Returns why a probe
        failed, or None."""
        st = self.settings
        small = [st.min_bytes] if st.min_bytes < LARGE_FRACTION * top else []
        for k, order in enumerate(sizes.repeats(top, MAX_REPEATS)):
            if k >= REPEATS and accepted(est)[0] is not None and settled(est):
                break
            # Whole passes only: a size probed once is no point of the fit (`link_estimate.GROUP_MIN_N`).
            if time.monotonic() + sum(GAP_S + per_byte * s for s in small + order) > t0 + self._budget_s():
                break
            for s in small + order:
                self._gap()
                rtt, error = self._ping(sw, s)
                if error is not None:
                    return error
                if rtt is not None:
                    est.add(s, rtt, t=time.monotonic())
        return None

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
                 "descheduled": len(self._spoiled), "descheduled_s": sum(t for _, t, _ in self._spoiled),
                 "descheduled_used": self._spoiled_used, "max_bytes": top,
                 "fit": None if fit is None else fit.to_dict(), "error": error}
        self.done.append(entry)
        rate = "no rate" if fit is None else f"{fit.rate_bps / 1e6:.3f} Mbit/s"
        log.info("%s: %s probe sweep (%s): %s, %d probes up to %d bytes in %.3f s%s", sw.name,
                 sw.direction.upper(), sw.why, rate, pings, top, now - t0, f" ({error})" if error else "")
        return entry

    def _ping(self, sw: Sweep, size: int) -> tuple[float | None, str | None]:
        """One probe of `size` bytes in the sweep's direction; (round trip minus the device's hold, None),
        (None, None) when it was set aside (the edge was descheduled meanwhile), or (None, why it failed)."""
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
        delay0 = self._run_delay.now()
        p.t_send = time.monotonic()
        srv.send(sw.name, frames)
        srv.poll(p.t_send + wait, stop=lambda: p.rtt is not None or p.error is not None or not self._session_ok(sw))
        self._pending = None
        waited = RunDelay.waited(delay0, self._run_delay.now())
        log.debug("%s: %s probe %d of %d bytes: %s", sw.name, sw.direction, p.id, size,
                  p.error or ("no echo" if p.rtt is None else f"{1e3 * p.rtt:.3f} ms"))
        if p.error is not None:
            return None, p.error
        if p.rtt is None:
            return None, (f"no echo within {wait:g} s" if self._session_ok(sw) else "the session ended")
        self._pings += 1
        if waited > DESCHEDULED_FLOOR_S and waited > DESCHEDULED_SHARE * p.rtt:
            # The edge's loop or ZeroMQ's I/O thread waited for a core meanwhile: this round trip measures the
            # host as well as the link (on a busy host such probes read sweeps 12-14% low). Set aside: the fit
            # takes it only if the sweep cannot tell without it.
            self._spoiled.append((size, p.rtt, time.monotonic()))
            log.debug("%s: probe %d set aside: the edge waited %.3f ms for a core", sw.name, p.id, 1e3 * waited)
            return None, None
        return p.rtt, None

    def _budget_s(self) -> float:
        """The sweep's time limit: `budget_s`, plus the time of the probes set aside (the edge was descheduled
        through them: the host's time, not the link's), up to `budget_s` more."""
        budget = self.settings.budget_s
        return budget + min(budget, sum(t for _, t, _ in self._spoiled))

    def _gap(self) -> None:
        self.server.poll(time.monotonic() + GAP_S)
