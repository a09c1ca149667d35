"""No input can kill a node (issue 9), the nodes' part: hypothesis fuzzing of all three node kinds, live.

- edge (`EdgeServer` in this thread, a fake verifier, as in tests/edge/test_edge_faults.py): this test plays a
  REGISTERED device session (a real register/registered exchange). Each example is one real round
  (`run_round`): the test answers its schedule with a mutated draft and arbitrary messages, the verdict with a
  mutated report and then the honest one. With a passthrough channel (a device's own `channel` annotation
  must be ignored) and a virtual one (the edge trusts it: forged annotations reach the record and the
  virtual clock). Property: nothing raises out of the round, the record is finite, the draft (report) is
  taken exactly when the wire validators accept it, every refused message is counted and answered (the
  malformed ones exactly), none needed the catch-all (`refusals["internal"]`), no draft failed verification;
  afterwards an honest scripted device completes rounds with valid records.
- channel emulator (`ChannelProxy` in a thread, as tests/emulator/test_channel_hardening.py's bench): frames on the
  frontend (device -> edge), from the edge (edge -> device) and on the control socket. Property: each message
  is forwarded exactly as the emulator's rules say (unchanged, its forged annotation stripped, charged and
  annotated, or a tx_start marker consumed) and counted; each control request gets a strict JSON reply, ok
  exactly when it is valid; nothing hits the guard (`counters["errors"]`); an honest device passes afterwards.
- device (one real `device_node.node` process, micro pair, against tests/device/test_device_faults.py's FakeEdge,
  after a real registration; all examples over one connection): schedules, verdicts of a drafted round,
  probes, heartbeats, registrations, garbage (never a bye or a fatal error: those end it by design). Property:
  a schedule is drafted exactly when valid, a verdict reported exactly when valid, each malformed message
  logged once, no internal error or traceback, the process alive and serving a valid round at the end.

FUZZ_EXAMPLES examples in all by default (the file took 26 s on a busy 2-core host), FUZZ_EXAMPLES_SLOW with
`-m slow` (19 min: each edge target ~8 min, the device 2, the emulator 1.5), split by TARGETS' weights.
Derandomized (every run makes the same draws; the edge's plan, and so the seed a draft mutation starts from,
depends on its timing), no shrinking (the nodes keep state between examples: the first failure is raised).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.extra import numpy as hnp
from support import (
    CHANNEL_INFO,
    KNOWN_KEYS,
    NASTY_RAW,
    SAMPLING,
    TIMINGS,
    FakeEdge,
    ScriptedDevice,
    V,
    at_path,
    containers_of,
    encode_spliced,
    json_values,
    make_server,
    mutate_frames,
    mutated_messages,
    paths_of,
    random_frames,
    random_json_headers,
    raw_marker,
    serve_one_round,
    start_device,
    stop,
)

from channel_emulator.proxy import ChannelControl, ChannelProxy, ConfigError, parse_configure
from device_node.options import ExitCode
from testbed.core.sampling import exact_from_wire, to_wire_precision
from testbed.runtime.records import RunRecorder, load_run
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

FUZZ_EXAMPLES = 2_000           # all targets together, default run
FUZZ_EXAMPLES_SLOW = 100_000    # all targets together, -m slow

# --- mutations of a valid message --------------------------------------------------------------------------

ARRAY_DTYPES = [np.int32, np.int64, np.float16, np.float32, np.float64, np.uint32, np.uint8]
ARRAY_NAMES = ["tokens", "q", "q_at", "q_ids", "q_p", "p", "pad", "prompt_ids"]


def _pick(draw, options: list, label: str = "pick"):
    """One of `options` (None if empty) by a draw whose range does not depend on them: the edge's seeds depend
    on its state (the round's mode and length), and hypothesis requires each draw's bounds to depend on the
    earlier draws only."""
    i = draw(st.integers(0, 2**16 - 1), label=label)
    return options[i % len(options)] if options else None


@st.composite
def mutated(draw, frames: list) -> list:
    """`frames`, a valid message, maybe left valid, else with 0-3 header fields (or new ones) set to nasty
    values (test_wire_fuzz's NASTY_RAW spliced verbatim: NaN, huge ints, deep JSON, "fast", ...), integers
    nudged (wrong rounds, counts off by one), fields deleted, an array swapped for one of another dtype, shape
    or content, and maybe a frame mutation on top (dropped, extra, truncated, scrambled, swapped frames).
    The draws are the same whatever `frames` holds (see `_pick`)."""
    frames = [bytes(f) for f in frames]
    if draw(st.integers(0, 5)) == 0:
        return frames
    header, arrays = P.decode(frames)
    header = {k: v for k, v in header.items() if k not in ("v", "arrays")}
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(ARRAY_NAMES))
        how = draw(st.sampled_from(["dtype", "shape", "values", "delete"]))
        dtype = draw(st.sampled_from(ARRAY_DTYPES))
        other = draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, max_side=8)))
        floats = draw(hnp.arrays(np.float64, 8))  # any float64 values, NaN and infinities included
        ints = draw(hnp.arrays(np.int64, 8))
        orig, arrays = arrays.get(name), dict(arrays)
        if how == "delete":
            arrays.pop(name, None)
        elif orig is None or how == "shape":
            arrays[name] = other
        elif how == "dtype":
            arrays[name] = orig.astype(dtype)
        else:  # the right layout, any content: NaN rows, ids out of range, rows that do not sum to 1
            with np.errstate(all="ignore"):
                fill = floats if orig.dtype.kind == "f" else ints
                arrays[name] = np.resize(fill, orig.shape).astype(orig.dtype)
        frames = [bytes(f) for f in P.encode(header, arrays)]
    header = json.loads(frames[0])
    splices: dict[bytes, bytes] = {}
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "raw", "raw", "nudge", "nudge", "delete", "add"]))
        own = draw(st.integers(0, 3)) != 3  # mostly the message's own fields, not its envelope
        where = draw(st.integers(0, 2**16 - 1))
        container = _pick(draw, containers_of(header), "container")
        new_key = draw(st.sampled_from(KNOWN_KEYS))
        delta = draw(st.sampled_from([-1, 1, 1, 2, 5, 100, -(2**31), 2**31, 2**62]))
        raw = draw(st.sampled_from(NASTY_RAW)) if action == "raw" or draw(st.booleans()) else None
        value = draw(json_values)
        paths = paths_of(header)
        if own:
            paths = [q for q in paths if q[0] not in ("v", "type", "arrays")] or paths
        if action == "nudge":
            paths = [q for q in paths if type(at_path(header, q)) is int]
        path = paths[where % len(paths)] if paths else None
        if action == "nudge":
            if path is not None:
                at_path(header, path[:-1])[path[-1]] = at_path(header, path) + delta
            continue
        if action == "delete" and path is not None:
            del at_path(header, path[:-1])[path[-1]]
            continue
        if action not in ("set", "raw") or path is None:
            path = container + (new_key,)
        if raw is not None:
            value = raw_marker(splices, raw)
        at_path(header, path[:-1])[path[-1]] = value
    frames[0] = encode_spliced(header, splices)
    return mutate_frames(draw, frames)


any_message = st.one_of(random_frames, random_json_headers(), mutated_messages())


def _decoded(frames: list, **kw):
    """What the node's guarded decode makes of `frames`: (header, arrays), or None (malformed)."""
    try:
        return P.decode(frames, **kw)
    except ProtocolError:
        return None


def _check_finite(value, path: str = "record") -> None:
    """Every number in a round record is finite (the controller promises it; the recorder would write null)."""
    if isinstance(value, dict):
        for k, x in value.items():
            _check_finite(x, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, x in enumerate(value):
            _check_finite(x, f"{path}[{i}]")
    elif isinstance(value, (float, np.floating)):
        assert math.isfinite(value), f"{path} = {value}"


class _Failed(BaseException):
    """Ends a hypothesis run at its first failure (`_run`)."""


def _run(total: int, name: str, step) -> None:
    """`step(data)` as a hypothesis test of this target's share of `total` examples, against one node.

    The node keeps its state from example to example, so a failed example cannot be replayed (hypothesis would
    report a confusing "flaky" error instead): the run ends at the first failure, which is raised with its
    assertion message (which shows the input)."""
    n = max(1, round(total * TARGETS[name] / sum(TARGETS.values())))
    failed: list[Exception] = []

    def guarded(data):
        try:
            step(data)
        except HypothesisException:  # its own signals (a rejected draw); StopTest is a BaseException
            raise
        except Exception as exc:
            failed.append(exc)
            raise _Failed from None

    try:
        settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))(given(st.data())(guarded))()
    except _Failed:
        raise failed[0] from None


# --- the edge --------------------------------------------------------------------------------------------

FUZZER, HONEST = "dev0", "dev1"
DEADLINE_S = 5.0


class EdgeFuzz:
    """An edge and the registered session `FUZZER` that this test plays. `server.run_round` runs the real
    round; its schedule and verdict phases are hooked (instance attributes over the methods) so that the
    fuzzer answers them within the round, as a device would, drawing its messages from the example."""

    def __init__(self, tmp_path, channel_mode: str):
        self.run_dir = tmp_path / "run"
        self.recorder = RunRecorder(self.run_dir)
        self.ep = f"ipc://{tmp_path}/edge"
        # No rate limit: the fuzzer sends faster than a device would, and a dropped message is not answered.
        self.server = make_server(self.ep, (FUZZER, HONEST), deadline_s=DEADLINE_S, recorder=self.recorder,
                                  channel_mode=channel_mode, max_msgs_per_s=None, heartbeat_s=1.0, liveness=5)
        self.trusted = channel_mode != "passthrough"  # without keys the edge takes annotations as the emulator's
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, FUZZER.encode())
        self.sock.connect(self.ep)
        self.logged: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda rec: self.logged.append(rec.getMessage())
        logging.getLogger("multispin.edge").addHandler(self.handler)
        schedule, verify = self.server.sync.schedule, self.server.sync.verify_and_reply

        def schedule_hook(r, rp, plan_s):
            cur = schedule(r, rp, plan_s)
            if FUZZER in cur.schedule:
                t = time.monotonic()
                self._answer_schedule(cur)
                self.hook_s += time.monotonic() - t
            return cur

        def verify_hook(cur, present):
            outcomes, verify_s = verify(cur, present)
            if FUZZER in outcomes:
                t = time.monotonic()
                self._answer_verdict(cur)
                self.hook_s += time.monotonic() - t
            return outcomes, verify_s

        self.server.sync.schedule, self.server.sync.verify_and_reply = schedule_hook, verify_hook
        self.round = 0
        self.syncs = 0
        self.stopped = None
        self.tally: Counter[str] = Counter()
        self.slowest = 0.0
        self.register()

    # the fuzzer's socket
    def send(self, frames: list) -> None:
        frames = [bytes(f) for f in frames] or [b""]
        self.sent.append(frames)
        self.sock.send_multipart(frames)

    def read(self, want, serve: bool = False, timeout_s: float = 5.0) -> dict:
        """Messages to the fuzzer into `inbox` until one whose header satisfies `want`; with `serve`, the edge
        serves meanwhile (outside a round's hooks)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if serve:
                self.server.poll(time.monotonic() + 0.02, stop=lambda: self.sock.poll(0))
            while self.sock.poll(0 if serve else 20):
                h, a = P.decode(self.sock.recv_multipart())
                self.inbox.append((h, a))
                if want(h):
                    return h
        raise AssertionError(f"no awaited message within {timeout_s} s; got {[h['type'] for h, _ in self.inbox]}")

    def register(self) -> None:
        self.inbox, self.sent = [], []
        self.send(M.register(FUZZER, V, {"name": "fuzzer"}))
        h = self.read(lambda h: h["type"] in (P.REGISTERED, P.ERROR), serve=True)
        assert h["type"] == P.REGISTERED, h
        self.committed = list(M.parse_registered(h, self.inbox[-1][1], vocab_size=V).prompt_ids)

    def sync(self) -> None:
        """Every message sent so far handled: the edge refuses (and answers) a type no device may send."""
        self.syncs += 1
        tag = f"fuzz-sync-{self.syncs}"
        self.send([P.encode_header({"type": tag})])
        self.read(lambda h: h["type"] == P.ERROR and tag in h["message"], serve=True)

    # the round's phases, as a device answers them
    def _answer_schedule(self, cur) -> None:
        h = self.read(lambda h: h["type"] == P.SCHEDULE and h["round"] == cur.index)
        sched = M.parse_schedule(h, max_draft_len=4)
        L, k = sched.draft_len, sched.topk
        q = np.zeros((L, V), np.float16)
        q[:, : k or V] = 1.0 / (k or V)
        seed = [bytes(f) for f in M.draft(sched.round, sched.mode, [0] * L, exact_from_wire(q), q_wire=q,
                                          last_token=self.committed[-1], bits_per_prob=16, on_air_vocab=None,
                                          timings=dict(TIMINGS), topk=k)]
        seed[0] = P.annotate_header(seed[0], channel=dict(CHANNEL_INFO))  # forged, or trusted as the emulator's
        self.sched, self.sid = sched, cur.sids[FUZZER]
        self.draft = self._draw(mutated(seed), "draft", seed)
        self.send(self.draft)
        self.extras = self._draw(st.lists(any_message, max_size=2), "then", [])
        for frames in self.extras:
            self.send(frames)
        # Ends the device's part of the round whatever came before (the round need not wait its deadline).
        self.send(M.error("fuzzer: no more drafts this round", round_index=sched.round))

    def _answer_verdict(self, cur) -> None:
        h = self.read(lambda h: h["type"] == P.VERDICT and h["round"] == cur.index)
        self.verdict = M.parse_verdict(h, self.inbox[-1][1], draft_len=self.sched.draft_len, vocab_size=V,
                                       bits_per_prob=16, on_air_vocab=None)
        v = self.verdict
        token = v.token if v.token is not None else int(np.argmax(v.p_row))  # a DL-mode correction
        dl = dict(CHANNEL_INFO, link="dl")
        self.honest_report = M.report(v.round, token, v.n_accepted, {"correction_s": 0.001}, dl)
        self.report = self._draw(mutated(self.honest_report), "report", self.honest_report)
        self.send(self.report)
        self.send(self.honest_report)

    def _draw(self, strategy, label: str, fallback):
        """A draw within the round. Hypothesis ends an example whose data runs out by raising from `draw`: then
        the round goes on with `fallback` (an honest message) and `step` raises that after its checks, so that
        no round is left half served."""
        if self.stopped is not None:
            return fallback
        try:
            return self.data.draw(strategy, label=label)
        except BaseException as exc:  # noqa: BLE001 - hypothesis' StopTest is a BaseException
            self.stopped = exc
            return fallback

    # oracles: the wire validators, the round's context, and the edge's rules for drafts and reports
    def draft_taken(self) -> bool:
        got = _decoded(self.draft, max_array_bytes=self.server.max_array_bytes)
        if got is None or got[0]["type"] != P.DRAFT or got[0].get("round") != self.sched.round:
            return False
        try:
            d = M.parse_draft(*got, mode=self.sched.mode, draft_len=self.sched.draft_len, vocab_size=V,
                              bits_per_prob=16, on_air_vocab=None, topk=self.sched.topk)
        except ProtocolError:
            return False
        return d.last_token == self.committed[-1] and (not self.trusted or got[0].get("air") == "ul")

    def report_taken(self) -> bool | None:
        """Whether the fuzzed report is the round's (None: it is no report, the honest one decides)."""
        got = _decoded(self.report)
        if got is None or got[0]["type"] != P.REPORT:
            return None
        try:
            rep = M.parse_report(got[0], V)
        except ProtocolError:
            return False
        v = self.verdict
        return rep.round == v.round and rep.n_accepted == v.n_accepted and v.token in (None, rep.token)

    def report_late(self) -> bool | None:
        """Whether the round's report is late (None: the fuzzed message is no report). A refused report of the
        awaited round ends the edge's wait for it; one naming another round leaves the honest one to decide."""
        taken = self.report_taken()
        if taken is None:
            return None
        return not taken and _decoded(self.report)[0].get("round") == self.verdict.round

    def step(self, data) -> None:
        server = self.server
        self.data, self.inbox, self.sent, self.verdict, self.sched, self.stopped = data, [], [], None, None, None
        self.hook_s = 0.0  # the fuzzer's part of the round (drawing its messages)
        refused, refusals = server.refused, Counter(server.refusals)
        r, self.round = self.round, self.round + 1
        rec = server.run_round(r)
        # The same draws whatever the round did (hypothesis requires it): a report even when no verdict came.
        if self.verdict is None:
            report = M.report(r, 0, 0, {"correction_s": 0.001}, dict(CHANNEL_INFO, link="dl"))
            self._draw(mutated(report), "report", None)
        self.sync()
        assert rec is not None and rec["round"] == r and self.sched is not None
        _check_finite(rec)
        edge_s = rec["measured"]["wall_round_s"] - self.hook_s
        assert edge_s < DEADLINE_S / 2, f"the round took {edge_s:.2f} s besides the fuzzer's: it waited its deadline"
        self.slowest = max(self.slowest, edge_s)
        same = server.sessions.get(FUZZER) is not None and server.sessions[FUZZER].sid == self.sid
        taken = self.draft_taken()
        self.tally["draft taken" if taken else "draft not taken"] += 1
        assert (FUZZER not in rec["missed"]) == taken, (taken, rec["missed"], self.draft)
        dev = rec["devices"][FUZZER]
        if taken:
            assert self.verdict is not None
            # A refused report of the awaited round ends the edge's wait for it (`report_late`): checked when no
            # other report came before the fuzzed one.
            others = [f for f in self.extras if (got := _decoded(f)) is not None and got[0]["type"] == P.REPORT]
            if same and not others and (late := self.report_late()) is not None:
                assert dev["report_late"] == late, (late, self.report)
                self.tally["report taken" if self.report_taken() else "report refused"] += 1
            if not self.trusted:
                assert dev["ul_channel"] is None and dev["dl_channel"] is None  # a device's claim is ignored
        # Every refusal answered once (no rate limit here), every malformed message counted as one.
        delta = Counter(server.refusals)
        delta.subtract(refusals)
        errors = sum(1 for h, _ in self.inbox if h["type"] == P.ERROR)
        assert server.refused - refused == errors, (server.refused - refused, errors)
        malformed = sum(1 for f in self.sent if _decoded(f, max_array_bytes=server.max_array_bytes) is None)
        assert delta["malformed"] == malformed, (delta, malformed)
        assert delta["internal"] == 0, [m for m in self.logged if "could not be handled" in m]
        assert not [m for m in self.logged if "could not be verified" in m]
        # The device's context, as the edge committed it.
        if not same:  # ended (a fatal error among its messages, too many misses): it registers again
            assert FUZZER not in server.sessions, "the fuzzer's session was replaced"  # it registers only here
            self.register()
        elif taken:
            v = self.verdict
            tokens = P.decode(self.draft)[1]["tokens"].tolist()
            final = v.token if v.token is not None else (
                P.decode(self.report)[0]["token"] if self.report_taken() else P.decode(self.honest_report)[0]["token"])
            self.committed += tokens[: v.n_accepted] + [final]
        if self.stopped is not None:
            raise self.stopped

    def finish(self) -> None:
        """The fuzzer leaves; an honest scripted device joins and completes rounds with valid records."""
        server = self.server
        self.inbox, self.sent = [], []
        self.send(M.error("fuzzer: done", fatal=True))
        server.poll(time.monotonic() + 5.0, stop=lambda: FUZZER not in server.sessions)
        assert FUZZER not in server.sessions
        honest = ScriptedDevice(self.ep, HONEST)
        honest.start()
        try:
            assert server.wait_for_devices([HONEST], 10.0) == []
            records = server.run(self.round + 3, start_round=self.round)
        finally:
            honest.stop.set()
            honest.join(5)
        assert len(records) == 3 and honest.verdicts == 3 and not honest.errors
        for rec in records:
            _check_finite(rec)
            assert rec["missed"] == [] and rec["devices"][HONEST]["measured"]["tokens"] > 0
            assert not rec["devices"][HONEST]["report_late"]

    def close(self) -> None:
        logging.getLogger("multispin.edge").removeHandler(self.handler)
        self.sock.close(linger=0)
        self.server.close()
        self.recorder.close()


def fuzz_edge(tmp_path, total: int, name: str) -> None:
    fz = EdgeFuzz(tmp_path, "passthrough" if name == "edge_passthrough" else "virtual")
    try:
        _run(total, name, fz.step)
        fz.finish()
        rounds_done = fz.server.rounds_done
        print(f"\n{name}: {fz.round} rounds (the slowest {fz.slowest:.3f} s), {dict(fz.tally)}, "
              f"refusals {dict(fz.server.refusals)}")
    finally:
        fz.close()
    _, on_disk = load_run(fz.run_dir)
    assert len(on_disk) == rounds_done == fz.round + 3  # every round recorded, as strict JSON lines


# --- the channel emulator ----------------------------------------------------------------------------------

TOKEN = "fuzz-token"
CONTROL_KEYS = ["type", "token", "round", "dl_access", "base_latency_s", "links", "lead_s", "lead_per_byte_s",
                "mode"]


@st.composite
def control_requests(draw) -> list:
    """A control request: a configure/stats/unknown request with fields of any value (raw splices of
    NASTY_RAW too), mostly versioned and with the token; sometimes random bytes or extra frames."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.lists(st.binary(max_size=128), min_size=1, max_size=2))
    msg = {"v": 1} if draw(st.integers(0, 9)) else {"v": draw(json_values)}
    msg["type"] = draw(st.sampled_from(["configure", "configure", "configure", "stats", "x", ""]))
    if draw(st.integers(0, 5)):
        msg["token"] = TOKEN
    elif draw(st.booleans()):
        msg["token"] = draw(json_values)
    names = st.sampled_from(["fz", "dev0", "", "\u00e9"])
    sane = draw(st.booleans())  # values of the right kinds (extremes included), or anything
    rates = st.one_of(st.none(), st.floats(5e-324, 1e300)) if sane else st.one_of(
        st.none(), st.floats(), st.integers(-(2**70), 2**70), json_values)
    msg["links"] = draw(st.one_of(
        st.dictionaries(names, st.fixed_dictionaries({}, optional={"ul_rate_bps": rates, "dl_rate_bps": rates}),
                        max_size=3), *([] if sane else [json_values])))
    fields = {"round": st.one_of(st.none(), st.integers(-(2**53), 2**53)),
              "dl_access": st.sampled_from(["tdma", "fdma_equal_split", "fdma_fixed_split", "x"]),
              "base_latency_s": st.floats(0, 1e300), "lead_s": st.floats(0, 1.5),
              "lead_per_byte_s": st.floats(0, 1.5), "mode": st.sampled_from(["real", "virtual", "x"])}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4)):
        msg[key] = draw(fields[key] if sane else json_values)
    splices: dict[bytes, bytes] = {}
    for key in draw(st.lists(st.sampled_from(CONTROL_KEYS), max_size=0 if sane else 2)):
        msg[key] = raw_marker(splices, draw(st.sampled_from(NASTY_RAW)))
    return [encode_spliced(msg, splices), *draw(st.lists(st.binary(max_size=16), max_size=1))]


def _control_valid(frame: bytes) -> bool:
    """The emulator's rules for a control request: strict versioned JSON, the token, a known type."""
    try:
        msg = P.decode_header(frame)
    except ProtocolError:
        return False
    if str(msg.get("token", "")) != TOKEN:
        return False
    if msg["type"] == "configure":
        try:
            parse_configure(msg)
        except ConfigError:
            return False
        return True
    return msg["type"] == "stats"


class ChannelFuzz:
    """A ChannelProxy in a thread (its own context), a plain ROUTER as the edge, the fuzzing device "fz"."""

    def __init__(self, tmp_path):
        eps = {k: f"ipc://{tmp_path}/{k}" for k in ("front", "edge", "ctl")}
        self.ctx = zmq.Context()
        self.edge = self._sock(zmq.ROUTER)
        self.edge.bind(eps["edge"])
        self.proxy = ChannelProxy(eps["front"], eps["edge"], eps["ctl"], control_token=TOKEN, max_msgs_per_s=1e9)
        self.thread = threading.Thread(target=self.proxy.run, daemon=True)
        self.thread.start()
        self.eps = eps
        self.dev = self.device(b"fz")
        self.req = self._sock(zmq.REQ)
        self.req.connect(eps["ctl"])
        self.control = ChannelControl(eps["ctl"], timeout_s=5, context=self.ctx, token=TOKEN)
        self.n = self.requests = self.accepted = 0
        self.dev.send_multipart(M.heartbeat())  # its DEALER to the edge exists from now on
        assert self.edge.recv_multipart()[0] == b"fz"

    def _sock(self, kind) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        return s

    def device(self, name: bytes) -> zmq.Socket:
        s = self._sock(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, name)
        s.connect(self.eps["front"])
        return s

    def _through(self, direction: str, frames: list) -> None:
        """Send `frames` one way, then a sync message; check what came out the other end and the counters."""
        self.n += 1
        sync = P.encode_header({"type": "fuzz-sync", "n": self.n})
        before = dict(self.proxy.counters)
        if direction == "ul":
            self.dev.send_multipart(frames)
            self.dev.send(sync)
        else:
            self.edge.send_multipart([b"fz", *frames])
            self.edge.send_multipart([b"fz", sync])
        got = []
        while True:
            if direction == "ul":
                ident, *body = self.edge.recv_multipart()
                assert ident == b"fz"
            else:
                body = self.dev.recv_multipart()
            if body == [sync]:
                break
            got.append(body)
        counts = Counter({k: v - before.get(k, 0) for k, v in self.proxy.counters.items()})
        h = 1 if len(frames) > 1 and len(frames[0]) == 0 else 0  # a REQ envelope's delimiter first
        try:
            header = P.decode_header(frames[h])
        except ProtocolError:
            header = None
        expect = Counter({"passed": 1})  # the sync, uncharged
        if header is None or header.get("air") not in ("ul", "dl"):
            expect["passed"] += 1
            out = list(frames)
            if header is None:
                expect["malformed"] += 1
            elif "channel" in header:
                expect["forged_annotation"] += 1
                out[h] = P.annotate_header(frames[h], channel=None)
            assert got == [out], (frames, got)
        elif header["type"] == P.TX_START:
            expect["markers"] += 1
            assert got == [], (frames, got)  # consumed: it starts the next charged message's air time
        else:
            expect["charged"] += 1
            expect["unconfigured"] += 1
            assert len(got) == 1 and len(got[0]) == len(frames), (frames, got)
            assert got[0][:h] + got[0][h + 1:] == frames[:h] + frames[h + 1:]
            annotated = P.decode_header(got[0][h])
            channel = annotated.pop("channel")
            assert annotated == {k: v for k, v in header.items() if k != "channel"}
            assert channel["bytes"] == sum(len(f) for f in frames) and channel["link"] == direction
        counts = +counts
        for key in ("passed", "malformed", "forged_annotation", "markers", "charged", "unconfigured"):
            assert counts[key] == expect[key], (key, counts, expect, frames)
        assert counts["errors"] == 0, (frames, counts)

    def _control(self, frames: list) -> None:
        try:
            if P.decode_header(frames[0])["type"] == "stop":
                return  # a valid stop stops the emulator: by design (the token guards it)
        except ProtocolError:
            pass
        errors = self.proxy.counters["errors"]
        self.req.send_multipart(frames)
        reply = P.parse_json(self.req.recv(), what="control reply")  # strict JSON: no NaN, bounded
        assert isinstance(reply, dict) and type(reply.get("ok")) is bool, reply
        assert reply["ok"] == _control_valid(frames[0]), (frames, reply)
        self.requests += 1
        self.accepted += reply["ok"]
        assert self.proxy.counters["errors"] == errors, (frames, reply)
        self.control.configure(links={})  # the next messages pass at once again

    def step(self, data) -> None:
        kind = data.draw(st.sampled_from(["ul", "ul", "dl", "control"]), label="kind")
        if kind == "control":
            self._control(data.draw(control_requests(), label="request"))
            return
        frames = data.draw(st.one_of(any_message, st.sampled_from(sorted(VALID_CHANNEL)).map(VALID_CHANNEL.get)
                                     .flatmap(mutated)), label="frames")
        frames = [bytes(f) for f in frames] or [b""]
        if data.draw(st.integers(0, 9), label="envelope") == 0:
            frames = [b"", *frames]
        self._through(kind, frames)
        assert self.thread.is_alive()

    def finish(self) -> None:
        assert self.thread.is_alive() and self.proxy.running
        self.control.configure(links={"honest": {"ul_rate_bps": 1e9, "dl_rate_bps": 1e9}})
        honest = self.device(b"honest")
        try:
            honest.send_multipart(M.register("honest", V, {}))
            ident, *body = self.edge.recv_multipart()
            assert ident == b"honest" and P.decode(body)[0]["type"] == P.REGISTER
            honest.send_multipart(M.report(0, 1, 0, {}, None))
            draft = [P.encode_header({"type": "draft", "air": "ul", "round": 0}), bytes(1000)]
            honest.send_multipart(draft)
            assert P.decode_header(self.edge.recv_multipart()[1])["type"] == P.REPORT
            ident, header, payload = self.edge.recv_multipart()
            channel = P.decode_header(header)["channel"]  # charged at its configured rate
            assert ident == b"honest" and payload == draft[1]
            assert channel["rate_bps"] == 1e9 and channel["bytes"] == len(draft[0]) + 1000
            self.edge.send_multipart([b"honest", *M.schedule(1, "UL", 2, 0.1, 0.1, 1.0)])
            assert P.decode_header(honest.recv_multipart()[0])["type"] == P.SCHEDULE
        finally:
            honest.close()
        stats = self.control.stats()
        assert stats["ok"] and stats["counters"]["errors"] == 0

    def close(self) -> None:
        self.proxy.running = False
        self.thread.join(5)
        for s in (self.dev, self.req, self.edge):
            s.close(linger=0)
        self.control.close()
        self.ctx.term()


def _valid_channel() -> dict[str, list]:
    """Seeds for the emulator: what passes it in a round, both ways (charged, markers, uncharged)."""
    q = to_wire_precision(np.full((2, V), 1.0 / V), 16)
    return {"draft": [bytes(f) for f in M.draft(3, "UL", [1, 2], exact_from_wire(q), q_wire=q, last_token=4,
                                                bits_per_prob=16, on_air_vocab=None, timings=dict(TIMINGS))],
            "verdict": [bytes(f) for f in M.verdict(3, 1, 7)],
            "annotated": [P.annotate_header(bytes(M.verdict(3, 1, 7)[0]), channel=dict(CHANNEL_INFO))],
            "marker": [P.tx_start_marker("ul")], "schedule": [bytes(f) for f in M.schedule(4, "DL", 2, 0.1, 0, 1)],
            "heartbeat": [bytes(f) for f in M.heartbeat()]}


VALID_CHANNEL = _valid_channel()


def fuzz_channel(tmp_path, total: int, name: str) -> None:
    fz = ChannelFuzz(tmp_path)
    try:
        _run(total, name, fz.step)
        fz.finish()
        print(f"\nchannel: {fz.n} messages, {fz.requests} control requests ({fz.accepted} valid), "
              f"counters {fz.proxy.counters}")
    finally:
        fz.close()


# --- the device --------------------------------------------------------------------------------------------

def _clean_registered() -> list:
    """FakeEdge.register's reply: no heartbeats (the device waits for the edge as long as it likes)."""
    return M.registered("s#0", [5, 6, 7, 8], seed=3, sampling=SAMPLING, bits_per_prob=16, on_air_vocab_size=None,
                        max_draft_len=6, tx_marker=False)


class DeviceFuzz:
    """One device process, registered with a FakeEdge; every example over its one connection. The session is
    FakeEdge.register's: L_max 6, b_p 16, no on-air padding, no markers, no heartbeats."""

    def __init__(self, micro_pair, tmp_path):
        from device_node.drafter import OnnxDrafter

        self.vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
        ep = f"ipc://{tmp_path}/edge"
        self.edge = FakeEdge(ep)
        self.log = tmp_path / "device.log"
        self.proc = start_device(micro_pair, ep, self.log)
        self.edge.register()  # the real register/registered exchange
        self.round = 100
        self.probes = 0
        self.malformed = 0
        self.tally: Counter[str] = Counter()
        p = to_wire_precision(np.full(self.vocab, 1.0 / self.vocab), 16)
        self.seeds = {
            "schedule": M.schedule(7, "UL", 2, 0.2, 0.0, 5.0), "schedule_dl": M.schedule(7, "DL", 3, 0.2, 0.1, 5.0),
            "schedule_topk": M.schedule(7, "UL", 2, 0.2, 0.0, 5.0, topk=4), "verdict": M.verdict(7, 1, 3),
            "verdict_p": M.verdict(7, 1, None, p_row=p, bits_per_prob=16), "dropped": M.dropped(7, "late"),
            "probe": M.probe(9, 16, pad=np.zeros(8, np.uint8)), "heartbeat": M.heartbeat(),
            "registered": _clean_registered(), "error": M.error("something", round_index=7),
            "marker": [P.tx_start_marker("dl")]}
        self.seeds = {k: [bytes(f) for f in v] for k, v in self.seeds.items()}

    def send(self, frames: list) -> None:
        frames = [bytes(f) for f in frames] or [b""]
        self.edge.send(frames)
        if _decoded(frames) is None:
            self.malformed += 1

    def sync(self) -> list[tuple[dict, dict]]:
        """Every message sent so far handled (a probe is echoed at once): what the device sent meanwhile."""
        self.probes += 1
        probe_id = 10**6 + self.probes
        self.edge.send(M.probe(probe_id, 0))
        got = []
        while True:
            h, a = self.edge.recv(timeout_s=10.0, skip=(P.HEARTBEAT, P.TX_START))
            if h["type"] == P.PROBE_ECHO and h["id"] == probe_id:
                return got
            got.append((h, a))

    def _harmless(self, frames: list) -> list:
        """A bye or a fatal error ends the device by design: such a message is swapped for a heartbeat."""
        got = _decoded([bytes(f) for f in frames] or [b""])
        if got is not None and (got[0]["type"] == P.BYE or (got[0]["type"] == P.ERROR and got[0].get("fatal") is True)):
            return [bytes(f) for f in M.heartbeat()]
        return frames

    def _schedule_answered(self, frames: list, got: list) -> None:
        """A schedule is drafted exactly when it is valid (the device holds no round in flight here)."""
        dec = _decoded(frames)
        sched = None
        if dec is not None and dec[0]["type"] == P.SCHEDULE:
            try:
                sched = M.parse_schedule(dec[0], 6, self.vocab)
            except ProtocolError:
                pass
        drafts = [(h, a) for h, a in got if h["type"] == P.DRAFT]
        if sched is None:
            assert drafts == [], (frames, [h for h, _ in got])
            return
        self.tally["fuzzed schedule drafted"] += 1
        assert len(drafts) == 1 and drafts[0][0]["round"] == sched.round, (frames, [h for h, _ in got])
        M.parse_draft(*drafts[0], mode=sched.mode, draft_len=sched.draft_len, vocab_size=self.vocab,
                      bits_per_prob=16, on_air_vocab=None, topk=sched.topk)
        self.send(M.dropped(sched.round, "fuzzer"))  # no round in flight for the next example

    def step(self, data) -> None:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        if data.draw(st.integers(0, 2), label="kind") == 0:
            self._round(data)
            return
        name = data.draw(st.sampled_from(["any", "schedule_near", *sorted(self.seeds)]), label="seed")
        if name == "schedule_near":  # fields around their bounds (L_max 6, V), then maybe mutated
            seed = M.schedule(data.draw(st.integers(-1, 2**31), label="round"),
                              data.draw(st.sampled_from(["UL", "DL", "ul", ""]), label="mode"),
                              data.draw(st.integers(-1, 8), label="draft_len"),
                              *data.draw(st.lists(st.floats(-1.0, 2e6), min_size=3, max_size=3), label="floats"),
                              topk=data.draw(st.one_of(st.none(), st.sampled_from([-1, 0, 1, self.vocab,
                                                                                   self.vocab + 1])), label="k"))
            frames = data.draw(mutated(seed), label="message")
        else:
            frames = data.draw(any_message if name == "any" else mutated(self.seeds[name]), label="message")
        frames = self._harmless(frames)
        self.send(frames)
        dec = _decoded([bytes(f) for f in frames] or [b""])
        if dec is not None and dec[0]["type"] == P.REGISTERED:
            self.edge.send(_clean_registered())  # back to this session's settings (a fuzzed one may be valid)
        got = self.sync()
        assert not [h for h, _ in got if h["type"] == P.REPORT]  # no round in flight: no verdict is taken
        self._schedule_answered(frames, got)
        for h, a in got:
            if h["type"] == P.PROBE_ECHO:
                assert M.parse_probe_echo(h, a).pad_bytes == M.parse_probe(*dec).reply_bytes

    def _round(self, data) -> None:
        """A valid schedule, its draft, then a fuzzed verdict: reported exactly when it is valid. Everything is
        drawn first (an example whose data runs out ends at a draw: not with a round in flight)."""
        r = self.round + 1
        mode = data.draw(st.sampled_from(["UL", "DL"]), label="mode")
        L = data.draw(st.integers(1, 6), label="draft_len")
        topk = data.draw(st.one_of(st.none(), st.integers(1, self.vocab)), label="topk")
        n = data.draw(st.integers(-1, L + 1), label="n_accepted")
        if mode == "DL" and n < L and data.draw(st.booleans(), label="p"):
            p = np.zeros(self.vocab)
            p[data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=1, max_size=8), label="p_support")] = 1.0
            seed = M.verdict(r, n, None, p_row=to_wire_precision(p / p.sum(), 16), bits_per_prob=16)
        elif data.draw(st.integers(0, 5), label="dropped") == 0:
            seed = M.dropped(r, "late")
        else:
            seed = M.verdict(r, n, data.draw(st.integers(-1, self.vocab), label="token"))
        frames = self._harmless(data.draw(mutated(seed), label="verdict"))
        self.round = r
        self.edge.send(M.schedule(r, mode, L, 0.2, 0.1, 5.0, topk=topk))
        got = self.sync()
        drafts = [(h, a) for h, a in got if h["type"] == P.DRAFT]
        assert len(drafts) == 1 and len(got) == 1, [h for h, _ in got]
        M.parse_draft(*drafts[0], mode=mode, draft_len=L, vocab_size=self.vocab, bits_per_prob=16, on_air_vocab=None,
                      topk=topk)
        self.send(frames)
        got = self.sync()
        reports = [h for h, _ in got if h["type"] == P.REPORT]
        v = self._verdict_taken(frames, r, mode, L)
        self.tally["verdict " + ("refused" if v is None else "dropped" if v.dropped else "reported")] += 1
        if v is None or v.dropped:
            assert reports == [], (frames, reports)
            self.send(M.dropped(r, "fuzzer"))  # the round may still be in flight on the device
            return
        assert len(reports) == 1, (frames, [h for h, _ in got])
        rep = M.parse_report(reports[0], self.vocab)
        assert (rep.round, rep.n_accepted) == (r, v.n_accepted) and v.token in (None, rep.token), (rep, v)

    def _verdict_taken(self, frames: list, r: int, mode: str, L: int) -> M.Verdict | None:
        dec = _decoded([bytes(f) for f in frames] or [b""])
        if dec is None or dec[0]["type"] != P.VERDICT or dec[0].get("round") != r:
            return None
        try:
            v = M.parse_verdict(*dec, draft_len=L, vocab_size=self.vocab, bits_per_prob=16, on_air_vocab=None)
        except ProtocolError:
            return None
        if v.token is None and (mode != "DL" or v.n_accepted >= L):
            return None
        return v

    def finish(self) -> None:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        self.edge.send(_clean_registered())
        serve_one_round(self.edge, 10**6, self.vocab)  # a valid schedule answered, its round served
        self.edge.send(M.done("fuzzing over"))
        assert self.proc.wait(20) == ExitCode.OK

    def close(self) -> None:
        stop(self.proc)
        self.edge.close()


def fuzz_device(micro_pair, tmp_path, total: int, name: str) -> None:
    fz = DeviceFuzz(micro_pair, tmp_path)
    try:
        _run(total, name, fz.step)
        fz.finish()
    finally:
        fz.close()
    text = fz.log.read_text()
    print(f"\ndevice: {fz.probes} syncs, {dict(fz.tally)}, {fz.malformed} malformed, "
          f"{text.count(': dropped a ')} messages dropped")
    assert "Traceback" not in text
    assert "internal error" not in text, [line for line in text.splitlines() if "internal error" in line][:5]
    assert text.count(": dropped a malformed message:") == fz.malformed


# --- the targets -------------------------------------------------------------------------------------------

# name -> weight in the example budget: 500 examples each by default. The device's 500 (one process, one
# connection, a probe round trip per example, a drafted round in a third of them) take ~10 s on a busy 2-core
# host, each edge's 500 rounds ~5-7 s, the emulator's ~2 s.
TARGETS = {"edge_passthrough": 3, "edge_virtual": 3, "channel": 3, "device": 3}


def _fuzz(name: str, total: int, request, tmp_path) -> None:
    if name.startswith("edge"):
        fuzz_edge(tmp_path, total, name)
    elif name == "channel":
        fuzz_channel(tmp_path, total, name)
    else:
        fuzz_device(request.getfixturevalue("micro_pair"), tmp_path, total, name)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_node_fuzz(name, request, tmp_path):
    _fuzz(name, FUZZ_EXAMPLES, request, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_node_fuzz_slow(name, request, tmp_path):
    _fuzz(name, FUZZ_EXAMPLES_SLOW, request, tmp_path)

