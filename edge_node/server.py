"""The edge node: a ZeroMQ ROUTER serving many devices, synchronous rounds, one batched verification.

Per round: the controller plans (estimates -> optimizer), the channel emulator gets the plan's rates, each
device gets its schedule; drafts are collected until the deadline; ONE `verifier.verify` call scores every
device's drafts; accept/reject runs here for every device (shared sampling code); UL-mode corrections are
sampled here, DL-mode devices get p_j and correct themselves; each device reports back; the round record
(predicted next to measured, per phase and device) is written.

Bad input (malformed, oversized, wrong sizes, NaN, unknown device) gets an error reply and a log line; the
others keep being served. A device that misses the deadline is dropped from the round, and from the
session after `max_misses` consecutive misses. Devices may register (join or rejoin) at any time; they
take part from the next round.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from testbed.controller import Controller, channel_links, round_record
from testbed.core.sampling import (
    RoundRandomness,
    SamplingParams,
    count_accepted,
    exact_from_wire,
    sample_correction,
    sample_from,
    to_probs,
    to_wire_precision,
)
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.edge")


@dataclass
class Session:
    name: str
    sid: str
    prompt_ids: list[int]
    hardware: dict
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] | None = None       # committed tokens the verifier has not seen yet; None = unknown
    misses: int = 0
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    done: bool = False
    awaiting_report: int | None = None      # round whose report (the DL-mode correction) the next round needs
    expected_token: int | None = None       # the token the edge sampled for that round (None: DL correction)
    last_n: int = 0
    last_drafts: list[int] = field(default_factory=list)
    report_round: int | None = None         # the round whose report is still to come (needed or not)


class EdgeServer:
    def __init__(self, bind: str, verifier, *, scenario, controller: Controller, prompts: list[list[int]],
                 sampling: SamplingParams, seed: int = 0, deadline_s: float = 10.0, max_misses: int = 2,
                 max_new_tokens: int = 0, on_air_vocab_size: int | None = None, vocab_size: int,
                 channel=None, channel_mode: str = "passthrough", base_latency_s: float = 0.0,
                 recorder=None, policy: str = "proposed", prompt_texts: list[str] | None = None,
                 max_array_bytes: int = P.MAX_ARRAY_BYTES, tx_marker: bool = True, context=None):
        self.verifier, self.scenario, self.controller = verifier, scenario, controller
        self.prompts, self.prompt_texts = prompts, prompt_texts or [""] * len(prompts)
        self.params, self.seed = sampling, seed
        self.deadline_s, self.max_misses, self.max_new_tokens = deadline_s, max_misses, max_new_tokens
        self.on_air, self.vocab = on_air_vocab_size, vocab_size
        self.bits = scenario.bits_per_prob
        P.wire_dtype(self.bits)  # fail early on an unsupported precision
        self.channel, self.channel_mode, self.base_latency_s = channel, channel_mode, base_latency_s
        self.recorder, self.policy = recorder, policy
        self.max_array_bytes, self.tx_marker = max_array_bytes, tx_marker
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a rejoining device (same name) takes over its identity
        # Refuse absurd messages at the transport too (the peer is disconnected, the edge goes on).
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_array_bytes + P.MAX_HEADER_BYTES)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sessions: dict[str, Session] = {}
        self.known = {d.name for d in scenario.devices}
        self._sid = itertools.count()
        self._inbox_drafts: dict[str, tuple[float, M.Draft]] = {}
        self._current: dict | None = None  # round in flight: {round, sched: {name: (mode, L)}}
        self.refused = 0
        self._finished: dict[str, Session] = {}
        self._reports: dict = {}
        self._next_plan = None
        self._unwritten: dict | None = None
        self.t_origin = time.monotonic()
        self.round_index = 0

    # -- transport -------------------------------------------------------------------------------
    def _send(self, name: str, frames: list) -> None:
        self.sock.send_multipart([name.encode(), *frames], copy=False)

    def _send_air(self, name: str, frames: list) -> None:
        if self.tx_marker and self.channel is not None:
            self._send(name, [P.tx_start_marker("dl")])
        self._send(name, frames)

    def _refuse(self, name: str, reason: str, round_index=None) -> None:
        self.refused += 1
        log.warning("refused a message from %r: %s", name, reason)
        try:
            self._send(name, M.error(reason, round_index=round_index))
        except zmq.ZMQError:
            pass

    def poll(self, until: float, stop=None) -> None:
        """Serve incoming messages until the monotonic time `until` or until `stop()` is true."""
        while True:
            if stop is not None and stop():
                return
            left = until - time.monotonic()
            if left <= 0:
                return
            if not self.sock.poll(max(1, int(left * 1000))):
                continue
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._dispatch(frames, time.monotonic())
                if stop is not None and stop():
                    return

    def _dispatch(self, frames: list, t_arr: float) -> None:
        name = frames[0].bytes.decode("utf-8", "replace")
        try:
            header, arrays = P.decode(frames[1:], max_array_bytes=self.max_array_bytes)
        except ProtocolError as exc:
            self._refuse(name, f"malformed message: {exc}")
            return
        kind = header["type"]
        try:
            if kind == P.TX_START:
                return  # a marker that reached us directly (no emulator in between)
            if kind == P.REGISTER:
                self._on_register(name, header)
            elif kind == P.DRAFT:
                self._on_draft(name, header, arrays, t_arr)
            elif kind == P.REPORT:
                self._on_report(name, header)
            else:
                raise ProtocolError(f"type: {kind!r} is not allowed from a device; allowed: register, draft, report")
        except ProtocolError as exc:
            self._refuse(name, str(exc), header.get("round"))

    # -- sessions --------------------------------------------------------------------------------
    def _on_register(self, name: str, header: dict) -> None:
        reg = M.parse_register(header)
        if reg.name != name:
            raise ProtocolError(f"register.name: {reg.name!r} differs from the socket identity {name!r}")
        if name not in self.known:
            raise ProtocolError(f"register.name: {name!r} is not a device of this profile; allowed: "
                                f"{sorted(self.known)}")
        if reg.vocab_size != self.vocab:
            raise ProtocolError(f"register.vocab_size: {reg.vocab_size} is not allowed; the target has {self.vocab}")
        old = self.sessions.pop(name, None)
        if old is not None:
            log.info("%s: re-registered; closing its old session %s", name, old.sid)
            self.verifier.close(old.sid)
        idx = sorted(self.known).index(name) % len(self.prompts)
        sid = f"{name}#{next(self._sid)}"
        prompt = list(self.prompts[idx])
        self.verifier.open(sid, prompt)
        self.sessions[name] = Session(name, sid, prompt, reg.hardware, pending=[])
        self._send(name, M.registered(sid, prompt, seed=self.seed, sampling=dataclasses.asdict(self.params),
                                      bits_per_prob=self.bits, on_air_vocab_size=self.on_air,
                                      max_draft_len=self.scenario.max_draft_len,
                                      tx_marker=self.tx_marker and self.channel_mode != "passthrough"))
        log.info("%s: registered (session %s, hardware %s)", name, sid, reg.hardware.get("name"))

    def _drop_session(self, name: str, reason: str) -> None:
        s = self.sessions.pop(name, None)
        if s is not None:
            self.verifier.close(s.sid)
            self._finished[name] = s
            log.warning("%s: left the session: %s", name, reason)
            try:
                self._send(name, M.done(reason))
            except zmq.ZMQError:
                pass

    def wait_for_devices(self, names: list[str], timeout_s: float) -> list[str]:
        """Serve registrations until all `names` registered or the timeout; returns those missing."""
        self.poll(time.monotonic() + timeout_s, stop=lambda: all(n in self.sessions for n in names))
        return [n for n in names if n not in self.sessions]

    # -- drafts and reports ----------------------------------------------------------------------
    def _on_draft(self, name: str, header: dict, arrays: dict, t_arr: float) -> None:
        cur = self._current
        s = self.sessions.get(name)
        if s is None:
            raise ProtocolError(f"draft from {name!r}, which is not registered; send register first")
        r = header.get("round")
        if cur is None or r != cur["round"] or name not in cur["sched"] or cur["closed"]:
            log.info("%s: discarding a draft for round %r (round in flight: %s)", name, r,
                     None if cur is None else cur["round"])
            return
        if name in self._inbox_drafts:
            raise ProtocolError(f"draft.round: a second draft for round {r}")
        mode, L = cur["sched"][name]
        d = M.parse_draft(header, arrays, mode=mode, draft_len=L, vocab_size=self.vocab, bits_per_prob=self.bits,
                          on_air_vocab=self.on_air)
        expected_last = (s.output_ids or s.prompt_ids)[-1]
        if d.last_token != expected_last:
            raise ProtocolError(f"draft.last_token: {d.last_token} does not match the committed context "
                                f"(last token {expected_last}); the device is out of sync")
        self._inbox_drafts[name] = (t_arr, d, sum(len(f) for f in arrays.values()))

    def _on_report(self, name: str, header: dict) -> None:
        s = self.sessions.get(name)
        if s is None:
            raise ProtocolError(f"report from {name!r}, which is not registered")
        rep = M.parse_report(header, self.vocab)
        if s.report_round != rep.round:
            raise ProtocolError(f"report.round: {rep.round} is not awaited (awaiting {s.report_round})")
        if rep.n_accepted != s.last_n:
            raise ProtocolError(f"report.n_accepted: {rep.n_accepted} differs from the verdict's {s.last_n}")
        if s.expected_token is not None and rep.token != s.expected_token:
            raise ProtocolError(f"report.token: {rep.token} differs from the token {s.expected_token} sent")
        s.report_round = None
        if s.awaiting_report == rep.round:
            # DL-mode correction sampled on the device: the verifier feeds it next round.
            s.output_ids.extend(s.last_drafts[: s.last_n] + [rep.token])
            s.pending = [rep.token]
            s.awaiting_report = None
        if self._current is not None and rep.round == self._current["round"]:
            self._reports[name] = (time.monotonic(), rep)

    # -- one round -------------------------------------------------------------------------------
    def _active_names(self) -> list[str]:
        return sorted(n for n, s in self.sessions.items() if not s.done and s.awaiting_report is None)

    def _plan(self, r: int, names: list[str]):
        t = time.monotonic()
        rp = self.controller.plan_round(r, names, t - self.t_origin)
        return rp, time.monotonic() - t

    def run_round(self, r: int) -> dict | None:
        """One synchronous round. While the devices draft, the previous round's record is written (fsync)
        and the next round is planned."""
        for n, s in list(self.sessions.items()):
            if s.awaiting_report is not None:  # its report never came: it sits this round out
                s.misses += 1
                log.warning("%s: no report for round %d yet (%d misses)", n, s.awaiting_report, s.misses)
                if s.misses >= self.max_misses:
                    self._drop_session(n, f"no report for round {s.awaiting_report}")
        names = self._active_names()
        if not names:
            self._flush_record()
            return None
        planned = self._next_plan
        self._next_plan = None
        if planned is not None and planned[0].round == r and planned[0].devices == names:
            rp, plan_s = planned
        else:  # a device joined, left or is late: plan for the devices actually here
            rp, plan_s = self._plan(r, names)
        if self.channel is not None:
            self.channel.configure(round=r, links=channel_links(rp), dl_access=rp.scenario.dl_access,
                                   base_latency_s=self.base_latency_s)
        sched = {n: (rp.per_device[n]["mode"], int(rp.per_device[n]["draft_len"])) for n in names}
        self._inbox_drafts, self._reports = {}, {}
        self._current = {"round": r, "sched": sched, "closed": False}
        t0 = time.monotonic()
        for n in names:
            d = rp.per_device[n]
            self._send(n, M.schedule(r, sched[n][0], sched[n][1], d.get("ul_power_w") or 0.0,
                                     d.get("dl_power_w") or 0.0, self.deadline_s))
        # While the devices draft: write the previous round's record and plan the next round (its
        # estimates then lag one round, which costs nothing measurable and keeps both off the critical path).
        self._flush_record()
        self._next_plan = self._plan(r + 1, names)
        deadline = t0 + self.deadline_s
        self.poll(deadline, stop=lambda: len(self._inbox_drafts) == len(names))
        self._current["closed"] = True
        present = [n for n in names if n in self._inbox_drafts]
        for n in names:
            if n in present:
                self.sessions[n].misses = 0
                continue
            s = self.sessions[n]
            s.misses += 1
            log.warning("%s: missed the deadline of round %d (%d in a row)", n, r, s.misses)
            self._send(n, M.dropped(r, f"no draft within {self.deadline_s} s"))
            if s.misses >= self.max_misses:
                self._drop_session(n, f"missed {s.misses} consecutive deadlines")

        outcome: dict[str, dict] = {}
        verify_s = None
        if present:
            items = [(self.sessions[n].sid, list(self.sessions[n].pending), self._inbox_drafts[n][1].tokens.tolist())
                     for n in present]
            tv = time.monotonic()
            logits = self.verifier.verify(items)
            verify_s = time.monotonic() - tv
            self.controller.observe_verify(sum(sched[n][1] + 1 for n in present), verify_s)
            for n, lg in zip(present, logits):
                outcome[n] = self._decide(r, n, sched[n], lg, t0)
                self.controller.observe_acceptance(n, outcome[n]["n_accepted"], sched[n][1])
                self.controller.observe_draft_time(n, outcome[n].get("draft_s") or 0.0, sched[n][1])
                charged = (outcome[n].get("ul_channel") or {}).get("bytes")
                if charged:
                    self.controller.observe_upload(charged, rp.per_device[n]["ul_bits"], rp.scenario.header_bits)
            # The round ends when every device holds its tokens, which only its report tells (tiny, not
            # charged); the report also carries the verdict's measured DL air time for the record.
            self.poll(time.monotonic() + self.deadline_s, stop=lambda: all(n in self._reports for n in present))
        t_end = time.monotonic()
        if present and len(present) == len(names):
            self.controller.observe_round(t_end - t0, rp.plan["round_time_s"], rp.scenario.round_overhead_s)
        for n in present:
            o = outcome[n]
            if n in self._reports:
                rep = self._reports[n][1]
                o["dl_channel"] = rep.dl_channel
                o["correction_s"] = rep.timings.get("correction_s")
                o["report_s"] = self._reports[n][0] - o["t_verdict"]
            else:
                o["report_late"] = True
        rec = round_record(rp, policy=self.policy, outcome=outcome, verify_s=verify_s, round_s=t_end - t0,
                           t_start_s=t0 - self.t_origin,
                           extra={"channel_mode": self.channel_mode, "plan_s": plan_s,
                                  "joined": sorted(set(self.sessions) - set(names))})
        for n in present:
            s = self.sessions.get(n)
            if s is not None and self.max_new_tokens and len(s.output_ids) >= self.max_new_tokens:
                s.done = True
                self._send(n, M.done(f"generated {len(s.output_ids)} tokens"))
        self._unwritten = rec
        return rec

    def _flush_record(self) -> None:
        if self._unwritten is not None and self.recorder is not None:
            self.recorder.append_round(self._unwritten)
        self._unwritten = None

    def _decide(self, r: int, name: str, sched: tuple[str, int], logits: np.ndarray, t0: float) -> dict:
        """Accept/reject for one device; UL: correction here; DL: send p_j (or the bonus token)."""
        mode, L = sched
        s = self.sessions[name]
        t_arr, d, nbytes = self._inbox_drafts[name]
        # p is used as exact_from_wire of its wire rows, in both modes: a DL device rebuilds the identical
        # p_j from the row it downloads, so UL and DL give identical tokens.
        p_wire = to_wire_precision(to_probs(np.asarray(logits, dtype=np.float32), self.params), self.bits)
        p = exact_from_wire(p_wire)
        rr = RoundRandomness(self.seed, name, r)
        toks = d.tokens
        n = count_accepted(toks, d.q_at, p[np.arange(L), toks], rr.acceptance_uniforms(L))
        dl_payload = "token"
        if n == L:
            token = sample_from(p[L], rr.final_uniform())
            frames = M.verdict(r, n, token)
        elif mode == "UL":
            token = sample_correction(p[n], d.q_rows[n], rr.final_uniform())
            frames = M.verdict(r, n, token)
        else:
            token = None
            dl_payload = "p"
            frames = M.verdict(r, n, None, p_row=p_wire[n], bits_per_prob=self.bits, on_air_vocab=self.on_air)
        self.verifier.commit(s.sid, n)
        s.pending = None
        s.expected_token, s.last_n, s.last_drafts, s.report_round = token, n, toks.tolist(), r
        if token is None:
            s.awaiting_report = r  # the device samples the correction; the next round needs its report
        else:
            # The edge knows the token: the next round can go ahead even if this report is late (it is
            # checked when it comes; the record marks it late).
            s.output_ids.extend(toks.tolist()[:n] + [token])
            s.pending = [token]
        s.rounds += 1
        s.accepted += n
        s.drafted += L
        dl_bytes = sum(len(f) for f in frames)
        t_verdict = time.monotonic()
        self._send_air(name, frames)
        tm = d.timings
        return {"n_accepted": n, "tokens": n + 1, "dl_payload": dl_payload, "ul_channel": d.channel,
                "ul_bytes": nbytes, "dl_bytes": dl_bytes, "up_phase_s": t_arr - t0, "t_verdict": t_verdict,
                "draft_s": tm.get("draft_s"), "compute_s": tm.get("compute_s"),
                "emulated_extra_s": tm.get("emulated_extra_s"), "compute_scale": tm.get("compute_scale")}

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, rounds: int, on_round=None, join_wait_s: float = 0.0) -> list[dict]:
        """Run up to `rounds` rounds (fewer if every session finishes); returns the round records."""
        records = []
        for r in range(rounds):
            self.round_index = r
            # Serve registrations that arrived between rounds (joins and rejoins).
            self.poll(time.monotonic() + join_wait_s)
            rec = self.run_round(r)
            if rec is None:
                if not any(not s.done for s in self.sessions.values()):
                    break
                # Everyone is waiting on a late report: give them time instead of burning rounds.
                self.poll(time.monotonic() + self.deadline_s,
                          stop=lambda: bool(self._active_names()))
                continue
            records.append(rec)
            if on_round is not None:
                on_round(rec)
        self._flush_record()
        return records

    def finish(self, reason: str = "run complete") -> dict:
        """Tell every device the run is over; return the sessions' outputs (token ids)."""
        out = {}
        for name in list(self.sessions):
            s = self.sessions[name]
            if not s.done:
                try:
                    self._send(name, M.done(reason))
                except zmq.ZMQError:
                    pass
            out[name] = s
        for name, s in getattr(self, "_finished", {}).items():
            out.setdefault(name, s)
        return out

    def close(self) -> None:
        self.sock.close(linger=200)
