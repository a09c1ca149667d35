"""The edge's watch on the channel emulator: its control calls, its process, and whether it still answers.

A channel emulator that stops answering ends the run with a TestbedError (asked between rounds, once a
heartbeat period); one whose process exited (`exited`, set by whoever started it) ends it within a tick, in
rounds too: drafts and reports cannot come through a dead emulator, so waiting out a round's deadline and a
control timeout would only delay the end."""

from __future__ import annotations

import time

from testbed.runtime.errors import TestbedError


class ChannelWatch:
    def __init__(self, channel, heartbeat_s: float, base_latency_s: float = 0.0):
        self.channel, self.heartbeat_s, self.base_latency_s = channel, heartbeat_s, base_latency_s
        # () -> why the emulator's process is gone, or None while it runs: set by whoever started it
        # (`testbed.run.session`); a cheap check each tick.
        self.exited = None
        self.down: str | None = None  # why the emulator is known dead: no further control calls
        self._last_probe = 0.0

    @property
    def where(self) -> str:
        return getattr(self.channel, "endpoint", "?")

    def check_process(self) -> None:
        """The emulator's process, asked without a request."""
        why = self.exited() if self.exited is not None else None
        if why is not None:
            self._dead(f"channel emulator at {self.where} {why}")

    def _dead(self, message: str):
        self.down = message
        raise TestbedError(message)

    def probe(self, now: float) -> None:
        """Between rounds, once a heartbeat period: a `stats` request proves the emulator answers."""
        if self.channel is None or now - self._last_probe < self.heartbeat_s:
            return
        self._last_probe = now
        self.call("stats", self.channel.stats)

    def configure(self, round_index: int | None, links: dict, dl_access: str) -> None:
        """The emulator's per-device rates (which also proves it answers)."""
        self.call("configure", self.channel.configure, round=round_index, links=links, dl_access=dl_access,
                  base_latency_s=self.base_latency_s)
        self._last_probe = time.monotonic()

    def call(self, what: str, fn, *args, **kwargs):
        """A request to the channel emulator; a dead or failing emulator ends the run with a clear error."""
        if self.down is not None:  # known dead: a request would only wait out its timeout
            raise TestbedError(self.down)
        self.check_process()  # died since the last tick (e.g. just before a round's configure)
        try:
            return fn(*args, **kwargs)
        except TimeoutError as exc:
            self.check_process()  # exited: say so rather than "did not answer"
            self._dead(f"channel emulator at {self.where} stopped answering ({what}: {exc})")
        except RuntimeError as exc:
            raise TestbedError(f"channel emulator at {self.where} failed ({what}: {exc})") from None
