"""A live view of a running run in the terminal (rich Live): the round, each device's mode, draft length and
power, measured against predicted, the throughput, and the request latency percentiles as they form.

`LiveView.update(record, requests)` after each round; `render()` is the whole view (a test renders it to a string
console). Used as a context manager, it redraws a few times a second; log lines print above it.
"""

from __future__ import annotations

import logging

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from testbed.analysis.serving import LABELS, LATENCIES, summarize


def _f(value, fmt: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(int(value), fmt) if fmt == "d" else format(scale * value, fmt)


class LiveView:
    def __init__(self, title: str, rounds: int | None = None, console: Console | None = None):
        self.console = console
        self._live: Live | None = None
        self.start_run(title, rounds)

    # -- state -------------------------------------------------------------------------------------
    def start_run(self, title: str, rounds: int | None = None) -> None:
        """A run's title and its counts from zero (a campaign's next run shows in the same view)."""
        self.title, self.rounds = title, rounds
        self.last: dict | None = None
        self.count = 0
        self.tokens = 0
        self.time_s = 0.0  # the rounds' time (the records' clock)
        self.predicted_tokens = 0.0
        self.predicted_time_s = 0.0
        self.requests: list[dict] = []

    def update(self, rec: dict, requests: list[dict] | None = None) -> None:
        """One more round record, and the requests finished so far (None: the run serves no requests)."""
        self.last, self.count = rec, self.count + 1
        m, p = rec.get("measured") or {}, rec.get("predicted") or {}
        self.tokens += int(m.get("tokens") or 0)
        self.time_s += float(m.get("round_s") or 0.0)
        if p.get("round_s") and p.get("tokens") is not None:
            self.predicted_tokens += float(p["tokens"])
            self.predicted_time_s += float(p["round_s"])
        if requests is not None:
            self.requests = list(requests)
        # No redraw here: Live redraws from its own thread a few times a second, off the round loop.

    def on_round(self, rec: dict, server=None, launcher=None) -> None:
        """`run_live`'s on_round: the record, and the server's finished requests."""
        queues = getattr(server, "requests", None)
        self.update(rec, queues.snapshot() if queues is not None else None)

    # -- drawing -----------------------------------------------------------------------------------
    def render(self):
        parts = [self._headline()]
        if self.last is not None:
            parts.append(self._devices())
        if self.requests:
            parts.append(self._latencies())
        return Group(*parts)

    def _headline(self) -> Text:
        if self.last is None:
            return Text(f"{self.title}: waiting for the first round", style="bold")
        meas = self.tokens / self.time_s if self.time_s > 0 else None
        pred = self.predicted_tokens / self.predicted_time_s if self.predicted_time_s > 0 else None
        of = f"/{self.rounds}" if self.rounds else ""
        rec = self.last
        return Text.assemble(
            (f"{self.title}  ", "bold"), f"round {rec.get('round')}{of}  ({self.count} recorded)\n",
            f"{self.tokens} tokens  goodput ", (f"{_f(meas, '.1f')}", "bold green"), " meas / ",
            (f"{_f(pred, '.1f')}", "cyan"), " pred tok/s  last round ",
            f"{_f((rec.get('measured') or {}).get('round_s'), '.1f', 1e3)} meas / "
            f"{_f((rec.get('predicted') or {}).get('round_s'), '.1f', 1e3)} pred ms")

    def _devices(self) -> Table:
        t = Table(title=None, box=None, pad_edge=False, header_style="bold")
        for col in ("device", "mode", "L", "UL power W", "tokens meas/pred", "uplink ms meas/pred", "accepted"):
            t.add_column(col, justify="left" if col in ("device", "mode") else "right")
        for name, d in sorted((self.last.get("devices") or {}).items()):
            m, p = d.get("measured") or {}, d.get("predicted") or {}
            status = "missed" if d.get("missed") else _f(d.get("n_accepted"), "d")
            t.add_row(name, str(d.get("mode")), _f(d.get("draft_len"), "d"), _f(d.get("ul_power_w"), ".3g"),
                      f"{_f(m.get('tokens'), 'd')}/{_f(p.get('tokens'), '.2f')}",
                      f"{_f(m.get('uplink_phase_s'), '.1f', 1e3)}/{_f(p.get('uplink_phase_s'), '.1f', 1e3)}",
                      status)
        return t

    def _latencies(self) -> Table:
        s = summarize(self.requests) or {}
        o = s.get("overall") or {}
        tput = o.get("throughput_tps")
        t = Table(title=f"{o.get('finished', 0)} requests finished, throughput {_f(tput, '.1f')} tok/s",
                  box=None, pad_edge=False, header_style="bold", title_justify="left")
        for col in ("latency ms", "p50", "p95", "p99", "pred p50"):
            t.add_column(col, justify="left" if col == "latency ms" else "right")
        for key in LATENCIES:
            q, pred = o.get(key), (o.get("predicted") or {}).get(key)
            if q is None:
                continue
            t.add_row(LABELS[key], _f(q["p50"], ".1f", 1e3), _f(q["p95"], ".1f", 1e3), _f(q["p99"], ".1f", 1e3),
                      _f(pred["p50"], ".1f", 1e3) if pred else "-")
        return t

    # -- on screen ---------------------------------------------------------------------------------
    def __enter__(self) -> LiveView:
        import sys

        before = sys.stderr
        self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4,
                          redirect_stdout=True, redirect_stderr=True)
        self._live.__enter__()
        # Log handlers hold the stream they were made with: point those on stderr at Live's, so that log lines
        # print above the view instead of through it.
        self._handlers = [(h, h.setStream(sys.stderr)) for h in logging.getLogger().handlers
                          if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is before
                          and sys.stderr is not before]
        return self

    def __exit__(self, *exc) -> None:
        live, self._live = self._live, None
        for handler, stream in getattr(self, "_handlers", []):
            handler.setStream(stream)
        self._handlers = []
        if live is not None:
            live.__exit__(*exc)
