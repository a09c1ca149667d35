"""Request-level serving at the edge: each device serves a queue of requests, one at a time, each a fresh
generation (docs/serving-metrics.md).

The edge holds the tokenizer and the prompts, so a device's queue is kept here on its behalf. A request starts
on an idle device once it has arrived: the edge opens a new session for it (a fresh verifier context) and sends
the device a `registered` with the request's prompt, which resets the device's drafter (a `registered` during
a session always did: docs/wire-protocol.md). A request is complete when it holds `max_new_tokens` tokens; its
session then idles (`Session.idle`: no rounds, no `bye`, heartbeats go on) until the device's next request.

Times are on the edge's monotonic clock, in seconds from the start of serving (the first round). A request's
tokens count as delivered at the end of the round whose reports confirmed them (`t_start_s + wall_round_s` of
the round record): tokens of one round arrive together.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("multispin.edge")


@dataclass
class Request:
    """One request and what serving it measured (seconds on the serving clock)."""

    id: str
    device: str
    arrival_s: float | None  # None: closed loop (it arrives when the device's previous request completes)
    prompt_ids: list[int]
    prompt_index: int
    max_new_tokens: int
    start_s: float | None = None
    sid: str | None = None
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per round with tokens
    rounds: list[int] = field(default_factory=list)
    predicted_round_s: list[float] = field(default_factory=list)  # the plan's round time, each round it drafted
    predicted_tokens: list[float] = field(default_factory=list)  # the plan's expected tokens for it, each round
    restarts: int = 0  # its device registered again while it was in service: started over

    @property
    def delivered(self) -> int:
        return sum(n for _, n in self.deliveries)

    def record(self, finished: bool) -> dict:
        """Its line of requests.jsonl."""
        times = [t for t, _ in self.deliveries]
        first = times[0] if times else None
        last = times[-1] if times else None
        n = self.delivered
        arrival = self.arrival_s
        ttft = None if first is None or arrival is None else first - arrival
        e2e = None if last is None or arrival is None else last - arrival
        pred_round = sum(self.predicted_round_s)
        pred_tokens = sum(self.predicted_tokens)
        return {
            "id": self.id, "device": self.device, "session": self.sid, "finished": finished,
            "prompt_index": self.prompt_index,
            "prompt_tokens": len(self.prompt_ids), "max_new_tokens": self.max_new_tokens, "output_tokens": n,
            "arrival_s": arrival, "start_s": self.start_s, "first_token_s": first, "last_token_s": last,
            "queue_s": None if self.start_s is None or arrival is None else self.start_s - arrival,
            "ttft_s": ttft, "e2e_s": e2e,
            "itl_s": [b - a for a, b in zip(times, times[1:])],
            "tokens_per_delivery": [k for _, k in self.deliveries],
            "tpot_s": (e2e - ttft) / (n - 1) if e2e is not None and n > 1 else None,
            "rounds": list(self.rounds), "restarts": self.restarts,
            # The model's view of the same rounds: per round its predicted time; per token the rounds' predicted
            # time over the tokens it expected of this device.
            "predicted": {"itl_s": pred_round / len(self.predicted_round_s) if self.predicted_round_s else None,
                          "tpot_s": pred_round / pred_tokens if pred_tokens > 0 else None},
        }


RECENT_REQUESTS = 1_000  # finished requests a live view's percentiles are taken over (the file keeps every one)


class RequestQueues:
    """Every device's requests: waiting, in service, done. `write(record)` keeps each finished one's record;
    without a writer `done` keeps them (with one it stays empty: a long run's memory must not grow with it)."""

    def __init__(self, plans: dict[str, list[Request]], write=None):
        self.waiting = {name: list(reqs) for name, reqs in plans.items()}
        self.serving: dict[str, Request] = {}
        self.done: list[dict] = []
        self.finished = 0  # requests served to their token limit (their records written or in `done`)
        self.recent: deque[dict] = deque(maxlen=RECENT_REQUESTS)  # the last records, for a live view
        self.write = write or self.done.append
        self.t0: float | None = None  # monotonic time serving began (the first `ready`)

    def now(self) -> float:
        return time.monotonic() - (self.t0 if self.t0 is not None else time.monotonic())

    @property
    def all_done(self) -> bool:
        return not self.serving and not any(self.waiting.values())

    def limit(self, name: str) -> int:
        """The token limit of the device's session: its request's (0: no request in service, no limit)."""
        req = self.serving.get(name)
        return req.max_new_tokens if req is not None else 0

    # -- opening and closing -----------------------------------------------------------------------
    def on_open(self, name: str, session) -> None:
        """A device registered (or again): its session idles until a request starts on it; a request that was
        in service starts over (the device lost its context), keeping its arrival time."""
        session.idle = True
        req = self.serving.pop(name, None)
        if req is not None:
            log.warning("%s: registered again while serving %s; the request starts over", name, req.id)
            req.restarts += 1
            req.deliveries, req.rounds, req.predicted_round_s, req.predicted_tokens = [], [], [], []
            self.waiting.setdefault(name, []).insert(0, req)

    def complete(self, name: str) -> None:
        """The device's request holds all its tokens: record it; the device idles until its next one."""
        req = self.serving.pop(name, None)
        if req is not None:
            self._keep(req.record(finished=True))
            waiting = self.waiting.get(name) or []
            if waiting and waiting[0].arrival_s is None:  # closed loop: the next arrives as this completes
                waiting[0].arrival_s = self.now()

    def close(self) -> None:
        """The run ends: every request in service or waiting is recorded as unfinished."""
        for req in list(self.serving.values()):
            self._keep(req.record(finished=False))
        for reqs in self.waiting.values():
            for req in reqs:
                self._keep(req.record(finished=False))
        self.serving, self.waiting = {}, {n: [] for n in self.waiting}

    def _keep(self, rec: dict) -> None:
        self.finished += bool(rec.get("finished"))
        self.recent.append(rec)
        self.write(rec)

    def snapshot(self) -> list[dict]:
        """The records of the last RECENT_REQUESTS requests finished (for a live view)."""
        return list(self.recent)

    # -- serving -----------------------------------------------------------------------------------
    def ready(self, srv) -> bool:
        """Before a round: start the requests that arrived on idle devices; while no device can draft, wait for
        the next arrival (serving messages meanwhile). False when every request is done or every device left."""
        if self.t0 is None:
            self.t0 = time.monotonic()
            for reqs in self.waiting.values():
                if reqs and reqs[0].arrival_s is None:
                    reqs[0].arrival_s = 0.0  # closed loop: the first request arrives as serving begins
        while True:
            self.admit(srv)
            if srv.roster.active_names() or any(not x.idle and not x.done for x in srv.sessions.values()):
                return True  # someone drafts, or waits on a late report (the round loop sits it out)
            if not self.work_left(srv):
                return False
            wake = self.next_arrival(srv)
            until = time.monotonic() + srv.config.deadline_s
            if wake is not None:
                until = min(until, self.t0 + wake)
            srv.poll(until, stop=lambda: bool(srv.roster.active_names()) or self.due(srv))

    def work_left(self, srv) -> bool:
        """Whether a device with a session has a request to serve (one that left takes its own with it; should
        it register again meanwhile, its request in service is queued again, `on_open`)."""
        return any(name in srv.sessions and (reqs or name in self.serving) for name, reqs in self.waiting.items())

    def next_arrival(self, srv) -> float | None:
        """The earliest arrival still to come at a device that has a session."""
        times = [reqs[0].arrival_s for name, reqs in self.waiting.items()
                 if reqs and name in srv.sessions and reqs[0].arrival_s is not None]
        return min(times) if times else None

    def due(self, srv) -> bool:
        """Whether a request has arrived for an idle device (`admit` would start it)."""
        now = self.now()
        return any(reqs and reqs[0].arrival_s is not None and reqs[0].arrival_s <= now
                   and name not in self.serving and name in srv.sessions and srv.sessions[name].idle
                   for name, reqs in self.waiting.items())

    def admit(self, srv) -> None:
        """Start each idle device's first waiting request that has arrived."""
        now = self.now()
        for name, reqs in self.waiting.items():
            s = srv.sessions.get(name)
            if not reqs or s is None or not s.idle or s.done or name in self.serving:
                continue
            if reqs[0].arrival_s is None or reqs[0].arrival_s > now:
                continue
            req = reqs.pop(0)
            req.sid = srv.roster.restart(name, req.prompt_ids)
            req.start_s = self.now()
            self.serving[name] = req
            log.info("%s: request %s started (waited %.3f s)", name, req.id, req.start_s - req.arrival_s)

    def on_record(self, rec: dict, sessions: dict, t_origin: float) -> None:
        """A round's record (times from the server's origin `t_origin`, monotonic): the tokens each request in
        service got in it, delivered at the round's end."""
        measured = rec.get("measured") or {}
        wall = measured.get("wall_round_s", measured.get("round_s"))
        if self.t0 is None or rec.get("t_start_s") is None or wall is None:
            return
        t_end = t_origin + rec["t_start_s"] + wall - self.t0  # on the serving clock
        for name, entry in (rec.get("devices") or {}).items():
            req, s = self.serving.get(name), sessions.get(name)
            if req is None or s is None or s.sid != req.sid:
                continue
            got = min(len(s.output_ids), req.max_new_tokens) - req.delivered
            if got > 0:
                req.deliveries.append((t_end, got))
            req.rounds.append(rec.get("round"))
            pred = entry.get("predicted") or {}
            round_s = (rec.get("predicted") or {}).get("round_s")
            if round_s is not None and pred.get("tokens") is not None:
                req.predicted_round_s.append(float(round_s))
                req.predicted_tokens.append(float(pred["tokens"]))
