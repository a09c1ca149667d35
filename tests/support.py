"""Helpers shared by test modules: fakes, scripted peers, process helpers and fuzzing strategies.

Test modules never import each other (pytest runs with --import-mode=importlib); what two of them share lives
here, and `tests/` is on sys.path (`pythonpath` in pyproject.toml), so `from support import ...` works from
any folder, and from code strings run by a subprocess that puts TESTS on its path."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq
from hypothesis import strategies as st

from channel_emulator.proxy import ChannelControl
from edge_node.controller import Controller, DeviceOutcome, round_record
from edge_node.server import EdgeServer
from testbed.core.sampling import (
    SamplingParams,
    count_accepted,
    exact_from_wire,
    sample_correction,
    sample_from,
    to_probs,
    to_wire_precision,
)
from testbed.run.launcher import child_env
from testbed.run.scenario_file import load_scenario
from testbed.runtime.security import (
    ClientKeys,
    make_client,
)
from testbed.runtime.security import (
    make_server as make_curve_server,
)
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import decode_header, encode_header

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""
TESTS = ROOT / "tests"
"""This folder: put it on sys.path in a subprocess to import this module."""


def wait_until(predicate, timeout_s: float, what: str = "the condition", step_s: float = 0.01):
    """Wait for `predicate()` to be truthy and return its value; fail naming `what` after `timeout_s`.

    For conditions with nothing to block on (a file's contents, a pid in /proc, a counter in another thread):
    it looks again every `step_s`. Where there is something to block on, block on it instead: a socket's poll,
    a process's wait, an Event. `timeout_s` is a deadline for a hung test, not a speed requirement."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(step_s)


# --- Runs of `multispin run` as a process (tests/run/test_run_lifecycle.py and the live tests) ---------------------

CLI = [sys.executable, "-c", "import sys; from testbed.cli import main; sys.exit(main(sys.argv[1:]))"]


def profile_data(pair, **overrides) -> dict:
    data = {
        "name": "micro", "rounds": 10, "seed": 7, "deadline_s": 3.0, "max_misses": 2,
        "prompts": ["def parse(text):", "import os"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer)},
        "channel": {"mode": "virtual"},
        "wait_for_devices_s": 60,
        "scenario": {
            "bits_per_prob": 16, "max_draft_len": 4, "uplink_bandwidth_hz": 2e6, "downlink_bandwidth_hz": 3e6,
            "downlink_power_w": 1.0,
            "devices": [{"name": f"d{i}", "distance_m": 100 + 150 * i, "draft_time_s": 0.001, "acceptance": 0.6}
                        for i in range(2)],
        },
    }
    data.update(overrides)
    return data


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (read from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_rounds(run_dir_parent: Path, n: int, proc: subprocess.Popen, timeout_s: float = 180) -> Path:
    """The run directory once its rounds.jsonl holds at least n lines."""

    def recorded():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        for d in run_dir_parent.glob("*"):
            f = d / "rounds.jsonl"
            if f.is_file() and f.read_text().count("\n") >= n:
                return d
        return None

    return wait_until(recorded, timeout_s, f"the run's first {n} rounds", step_s=0.1)


def start_run(prof: Path, runs: Path, *extra: str, new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "run", str(prof), "--runs-dir", str(runs), "--quiet", "--no-plots", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def records_so_far(run_dir: Path) -> list[dict]:
    """The whole lines of a run's rounds.jsonl: read while the run writes it, the last may be half written."""
    lines = (Path(run_dir) / "rounds.jsonl").read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]


def device_pid(children: list[int], name: str) -> int:
    """The pid of device `name`'s `device_node.node` process among `children`."""
    (pid,) = [p for p in children
              if b"device_node.node" in (argv := Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0"))
              and name.encode() in argv]
    return pid


def kill_all(procs) -> None:
    for p in procs:
        if isinstance(p, int):
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        elif p.poll() is None:
            p.kill()
            p.wait(5)


# --- A fake edge against a real device process (tests/device/test_device_faults.py) --------------------------------

NAME = "dev-f"


SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


class FakeEdge:
    """A ROUTER that plays the edge for one device (a CURVE server with `keys`)."""

    def __init__(self, endpoint: str, keys=None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        make_curve_server(self.sock, keys)
        self.sock.bind(endpoint)
        self.keys = keys
        self.ident = NAME.encode()  # with keys the device lets ZeroMQ pick its routing id: the latest sender's

    def send(self, frames) -> None:
        self.sock.send_multipart([self.ident, *frames])

    def recv(self, timeout_s: float = 20.0, skip=(P.HEARTBEAT,)):
        """The next message of the device whose type is not in `skip`."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            ident, *frames = self.sock.recv_multipart(copy=False)
            if self.keys is None:
                assert ident.bytes == NAME.encode()
            else:  # the device is the name its key is bound to
                assert frames[0].get("User-Id") == NAME
                self.ident = ident.bytes
            frames = [f.bytes for f in frames]
            header, arrays = P.decode(frames)
            if header["type"] not in skip:
                return header, arrays
        raise AssertionError("the device sent nothing in time")

    def register(self, **liveness):
        h, _ = self.recv()
        assert h["type"] == "register"
        self.send(M.registered("s#0", [5, 6, 7, 8], seed=3, sampling=SAMPLING, bits_per_prob=16,
                               on_air_vocab_size=None, max_draft_len=6, tx_marker=False, **liveness))
        return h

    def close(self) -> None:
        self.sock.close(linger=0)


def start_device(micro_pair, endpoint: str, log_path, *extra: str, draft=None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "device_node.node", "--connect", endpoint, "--name", NAME,
            "--draft", str(draft or micro_pair.draft_onnx), "--register-timeout", "30", *extra]
    return subprocess.Popen(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=child_env())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def next_draft(edge: FakeEdge, r: int):
    h, a = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
    while h["type"] != "draft" or h["round"] != r:  # e.g. a fuzzed schedule that happened to be valid
        h, a = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
    return h, a


def serve_one_round(edge: FakeEdge, r: int, vocab: int) -> int:
    """A real UL round: schedule -> draft -> verdict (first token accepted + a correction) -> report;
    returns the round's last token (the device's context now ends with it)."""
    edge.send(M.schedule(r, "UL", 2, 0.2, 0.0, 5.0))
    h, a = next_draft(edge, r)
    d = M.parse_draft(h, a, mode="UL", draft_len=2, vocab_size=vocab, bits_per_prob=16, on_air_vocab=None)
    token = (int(d.tokens[1]) + 1) % vocab
    edge.send(M.verdict(r, 1, token))
    h, _ = edge.recv()
    while h["type"] != "report":
        h, _ = edge.recv()
    assert h["round"] == r and h["n_accepted"] == 1 and h["token"] == token
    return token


# --- The edge in the test's thread with scripted devices (tests/edge/test_edge_faults.py) --------------------------

V = 64  # the scripted devices' vocabulary


class FakeVerifier:
    """The verifier's interface without a model: uniform target logits, so p == q and every draft passes."""

    def __init__(self, vocab_size: int = V):
        self.vocab_size = vocab_size
        self.open_sids: set[str] = set()
        self.fail_open: set[str] = set()  # device names whose session cannot be opened (a "bug")

    def open(self, sid, prompt):
        if sid.split("#")[0] in self.fail_open:
            raise KeyError("simulated failure")
        self.open_sids.add(sid)

    def close(self, sid):
        self.open_sids.discard(sid)

    def commit(self, sid, n):
        assert sid in self.open_sids

    def verify(self, items):
        return [np.zeros((len(drafts) + 1, self.vocab_size), np.float32) for _, _, drafts in items]


def make_server(endpoint, names=("dev0", "dev1"), *, vocab=V, deadline_s=2.0, max_misses=1000, recorder=None,
                heartbeat_s=0.2, liveness=3, **kw):
    scen = load_scenario({"bits_per_prob": 16, "max_draft_len": 4, "vocab_size": vocab,
                          "devices": [{"name": n, "distance_m": 100 + 50 * i, "draft_time_s": 0.001,
                                       "acceptance": 0.9} for i, n in enumerate(names)]})
    return EdgeServer(endpoint, kw.pop("verifier", None) or FakeVerifier(vocab), scenario=scen,
                      controller=Controller(scen), prompts=[[1, 2, 3]], sampling=SamplingParams(), vocab_size=vocab,
                      deadline_s=deadline_s, max_misses=max_misses, recorder=recorder, heartbeat_s=heartbeat_s,
                      liveness=liveness, **kw)


class ScriptedDevice(threading.Thread):
    """A device speaking the protocol without a model: drafts token 1 with a uniform q.

    behaviour: "honest"; "bad_draft" (every draft has the wrong mode: refused); "no_report" (never reports);
    "forge" (claims a channel annotation and odd timings in its drafts); "refuse_schedule" (answers every
    schedule with a non-fatal error naming its round); "stale_report_first" (before each report, one naming
    a round long past: refused). `features`: what it lists in its `register` (`schedule_in_verdict`: it drafts
    the schedule a verdict carries, after its report).
    """

    def __init__(self, endpoint: str, name: str, behaviour: str = "honest", keys: ClientKeys | None = None,
                 context: zmq.Context | None = None, vocab: int = V, features: tuple[str, ...] = ()):
        super().__init__(daemon=True)
        self.endpoint, self.name, self.behaviour, self.keys, self.vocab = endpoint, name, behaviour, keys, vocab
        self.features = features
        self.schedules = 0          # schedule messages received
        self.schedules_inside = 0   # schedules received inside a verdict
        self.verdict_bytes: list[int] = []  # each verdict's bytes without a schedule inside
        self.ctx = context or zmq.Context.instance()
        self.stop = threading.Event()
        self.registered: M.Registered | None = None
        self.errors: list[str] = []
        self.verdicts = 0
        self.dropped = 0
        self.heartbeats = 0
        self.bye: str | None = None

    def run(self):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        make_client(sock, self.keys)
        sock.connect(self.endpoint)
        try:
            self._serve(sock)
        finally:
            sock.close(linger=0)

    def _serve(self, sock):
        sock.send_multipart(M.register(self.name, self.vocab, {"name": "scripted"}, features=self.features))
        last_sent, committed, pending = time.monotonic(), [], None
        while not self.stop.is_set() and self.bye is None:
            if self.registered and time.monotonic() - last_sent >= self.registered.heartbeat_s:
                sock.send_multipart(M.heartbeat())  # only while it holds a session
                last_sent = time.monotonic()
            if not sock.poll(20):
                continue
            h, a = P.decode(sock.recv_multipart(copy=False))
            kind = h["type"]
            if kind == P.REGISTERED:
                self.registered = M.parse_registered(h, a, vocab_size=self.vocab)
                committed = list(self.registered.prompt_ids)
            elif kind == P.SCHEDULE:
                self.schedules += 1
                pending = M.parse_schedule(h, 4)
                if self.behaviour == "refuse_schedule":  # as a device holding an unverified draft answers
                    sock.send_multipart(M.error("refused the schedule", round_index=pending.round))
                else:
                    sock.send_multipart(self._draft(pending, committed[-1]))
            elif kind == P.VERDICT and h.get("dropped"):
                self.dropped += 1
            elif kind == P.VERDICT:
                v = M.parse_verdict(h, a, draft_len=pending.draft_len, vocab_size=self.vocab, bits_per_prob=16,
                                    on_air_vocab=None)
                committed += [1] * v.n_accepted + [v.token]
                self.verdicts += 1
                if self.behaviour == "stale_report_first":
                    sock.send_multipart(M.report(v.round + 7, v.token, v.n_accepted, {"correction_s": 0.0}, None))
                if self.behaviour != "no_report":
                    sock.send_multipart(M.report(v.round, v.token, v.n_accepted, {"correction_s": 0.0}, v.channel))
                self.verdict_bytes.append(sum(len(f) for f in M.verdict(v.round, v.n_accepted, v.token)))
                nxt = M.schedule_in(h)
                if nxt is not None:
                    self.schedules_inside += 1
                    pending = M.parse_schedule(nxt, 4)
                    sock.send_multipart(self._draft(pending, committed[-1]))
            elif kind == P.ERROR:
                self.errors.append(h["message"])
            elif kind == P.HEARTBEAT:
                self.heartbeats += 1
            elif kind == P.BYE:
                self.bye = h["reason"]
            else:
                continue
            last_sent = time.monotonic() if kind in (P.SCHEDULE, P.VERDICT) else last_sent

    def _draft(self, sched: M.Schedule, last_token: int) -> list:
        L = sched.draft_len
        mode = sched.mode
        if self.behaviour == "bad_draft":
            mode = "DL" if mode == "UL" else "UL"
        q = np.full((L, self.vocab), 1.0 / self.vocab, np.float16)
        frames = M.draft(sched.round, mode, [1] * L, q.astype(np.float64), q_wire=q, last_token=last_token,
                         bits_per_prob=16, on_air_vocab=None, timings={"draft_s": 0.001})
        if self.behaviour == "forge":
            header = json.loads(bytes(frames[0]))
            header["channel"] = {"bytes": 1, "held_s": 0.0, "airtime_s": 0.0, "mode": "real", "link": "ul"}
            header["timings"] = {"draft_s": 1e9, "compute_s": 0.0, "emulated_extra_s": 1e-300}
            header.pop("v")
            frames = [P.encode_header(header), *frames[1:]]
        return frames


# --- Hypothesis strategies of the wire fuzzing (tests/wire/test_wire_fuzz.py, tests/system/test_node_fuzz.py) ------

FUZZ_V, FUZZ_L, FUZZ_ON_AIR = 50, 3, 64  # the receiver's context: vocabulary, scheduled draft length, on-air width

def _q(rows: int, seed: int = 0) -> np.ndarray:
    q = np.random.default_rng(seed).random((rows, FUZZ_V)).astype(np.float32) + 0.01
    return q / q.sum(axis=1, keepdims=True)


CHANNEL_INFO = {"bytes": 1234, "rate_bps": 1e6, "airtime_s": 0.01, "base_latency_s": 0.001, "queued_s": 0.0,
            "mode": "real", "link": "ul", "round": 4, "dl_access": "tdma", "marker": True, "lead_s": 0.0,
            "held_s": 0.011, "late_s": 1e-4}


TIMINGS = {"draft_s": 0.1, "compute_s": 0.05, "emulated_extra_s": 0.05, "compute_scale": 2.0}


def _flat(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


def _annotated(frames: list) -> list[bytes]:
    out = _flat(frames)
    out[0] = P.annotate_header(out[0], channel=CHANNEL_INFO)
    return out


def _valid_messages() -> dict[str, list[bytes]]:
    wire = to_wire_precision(_q(FUZZ_L), 16)
    q_exact = exact_from_wire(wire)
    toks = [1, 7, 49]
    p = to_wire_precision(_q(1, seed=1)[0], 16)
    return {
        "register": _flat(M.register("dev0", FUZZ_V, {"name": "phone", "compute_scale": 2.0, "threads": 1,
                                                 "description": "a phone"})),
        "registered": _flat(M.registered("dev0#1", [1, 2, 3], seed=7,
                                         sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                                         bits_per_prob=16, on_air_vocab_size=FUZZ_ON_AIR, max_draft_len=8)),
        "error": _flat(M.error("bad draft", round_index=3)),
        "bye": _flat(M.done("run complete")),
        "schedule": _flat(M.schedule(2, "DL", FUZZ_L, 0.2, 0.1, 3.0)),
        "draft_ul": _annotated(M.draft(4, "UL", toks, q_exact, q_wire=wire, last_token=9, bits_per_prob=16,
                                       on_air_vocab=FUZZ_ON_AIR, timings=TIMINGS)),
        "draft_dl": _annotated(M.draft(4, "DL", toks, q_exact, last_token=9, bits_per_prob=16,
                                       on_air_vocab=FUZZ_ON_AIR, timings=TIMINGS)),
        "verdict_token": _annotated(M.verdict(4, 2, 17)),
        "verdict_p": _annotated(M.verdict(4, 1, None, p_row=p, bits_per_prob=16, on_air_vocab=FUZZ_ON_AIR)),
        "verdict_dropped": _flat(M.dropped(4, "late")),
        "report": _flat(M.report(4, 17, 2, {"correction_s": 0.001}, dict(CHANNEL_INFO, link="dl"))),
        "tx_start": [P.tx_start_marker("ul")],
    }


VALID = _valid_messages()


# JSON text that Python's json accepts but the protocol must refuse, spliced in verbatim.
NASTY_RAW = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"9" * 4301, b"-" + b"9" * 5000,
             b"99999999999999999999", b"9223372036854775808", b"1" + b"0" * 400 + b".0", b'"\\ud800"',
             b'"\\udfff x"', b"[" * 1500 + b"]" * 1500, b'{"a":' * 40 + b"1" + b"}" * 40,
             b"[" * 17 + b"1" + b"]" * 17,
             b"true", b"false", b"null", b'"fast"', b'""', b"[]", b"{}", b"-1", b"0", b"1.5", b"-0.0", b"1e308",
             b"2147483648", b"16777217", b"[4294967296,4294967296]", b"[true]", b"[2,-1]", b"[1,1,1,1,1]",
             b'"' + b"x" * 5000 + b'"', b'{"bytes":"lots"}', b'{"held_s":1e400}']


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))


json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)), max_leaves=12)


# Keys a mutation may add: every field any message has, so that a field can appear where it is not expected.
KNOWN_KEYS = sorted({"v", "type", "arrays", "round", "mode", "draft_len", "ul_power_w", "dl_power_w", "deadline_s",
                     "last_token", "timings", "channel", "dl_channel", "air", "n_accepted", "token", "dropped",
                     "reason", "message", "fatal", "name", "vocab_size", "hardware", "session", "seed", "sampling",
                     "bits_per_prob", "on_air_vocab_size", "max_draft_len", "tx_marker", "shape", "dtype",
                     *CHANNEL_INFO, *TIMINGS, "correction_s", "temperature", "top_k", "top_p", "compute_scale"})


def paths_of(value, prefix=()) -> list[tuple]:
    """Every place in a parsed header (dict keys and list indices), depth first."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, x in items:
        out.append(prefix + (k,))
        out += paths_of(x, prefix + (k,))
    return out


def containers_of(value, prefix=()) -> list[tuple]:
    out = [prefix] if isinstance(value, dict) else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, x in items:
        out += containers_of(x, prefix + (k,))
    return out


def at_path(root, path):
    for k in path:
        root = root[k]
    return root


def raw_marker(splices: dict[bytes, bytes], raw: bytes) -> str:
    """A placeholder value standing for `raw` (bytes JSON cannot carry: NaN, huge ints, deep nesting), which
    `encode_spliced` puts in its place."""
    marker = f"@@raw{len(splices)}@@"
    splices[json.dumps(marker).encode()] = raw
    return marker


def encode_spliced(header: dict, splices: dict[bytes, bytes]) -> bytes:
    """`header` as JSON with each `raw_marker` replaced by its raw bytes."""
    text = json.dumps(header).encode()
    for marker, raw in splices.items():
        text = text.replace(marker, raw)
    return text


@st.composite
def mutated_messages(draw) -> list:
    """A valid message of a random type, 1-3 of its fields (or new ones) set to nasty values, maybe a frame
    mutation on top."""
    frames = list(VALID[draw(st.sampled_from(sorted(VALID)))])
    header = json.loads(frames[0])
    splices: dict[bytes, bytes] = {}
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "set", "raw", "raw", "delete", "add"]))
        paths = paths_of(header)
        # Mostly the message's own fields: a broken envelope (v, type, the arrays table) stops at decode and
        # would leave the parse_* functions little to chew on.
        if draw(st.integers(0, 3)) != 3:
            paths = [q for q in paths if q[0] not in ("v", "type", "arrays")] or paths
        if action in ("set", "raw") and paths:
            path = draw(st.sampled_from(paths))
        elif action == "delete" and paths:
            path = draw(st.sampled_from(paths))
            parent = at_path(header, path[:-1])
            del parent[path[-1]]
            continue
        else:
            path = draw(st.sampled_from(containers_of(header))) + (draw(st.sampled_from(KNOWN_KEYS)),)
        if draw(st.booleans()) or action == "raw":
            value = raw_marker(splices, draw(st.sampled_from(NASTY_RAW)))
        else:
            value = draw(json_values)
        at_path(header, path[:-1])[path[-1]] = value
    frames[0] = encode_spliced(header, splices)
    return mutate_frames(draw, frames)


def mutate_frames(draw, frames: list) -> list:
    """One frame-level mutation (drop, extra, truncate, scramble, swap, or none); the draws are the same
    whatever `frames` holds, so an example shrinks without changing what was drawn."""
    action = draw(st.sampled_from(["none", "none", "none", "drop", "extra", "truncate", "scramble", "swap"]))
    i = 1 + draw(st.integers(0, 2**16 - 1)) % max(1, len(frames) - 1)
    cut, noise = draw(st.integers(0, 2**16 - 1)), draw(st.integers(0, 2**32 - 1))
    extra = draw(st.binary(max_size=64))
    if action == "drop" and len(frames) > 1:
        del frames[i]
    elif action == "extra":
        frames.append(extra)
    elif action == "truncate" and len(frames) > 1:
        frames[i] = frames[i][: cut % max(1, len(frames[i]))]
    elif action == "scramble" and len(frames) > 1:  # same length, random content: NaN rows, bad ids
        frames[i] = np.random.default_rng(noise).bytes(len(frames[i]))
    elif action == "swap" and len(frames) > 2:
        frames[1], frames[2] = frames[2], frames[1]
    return frames


random_frames = st.lists(st.binary(max_size=512), max_size=P.MAX_FRAMES + 2)


@st.composite
def random_json_headers(draw) -> list:
    """A JSON object with a version and a type (so it gets past the envelope checks) and random fields."""
    body = draw(st.dictionaries(st.sampled_from(KNOWN_KEYS), json_values, max_size=6))
    body.setdefault("v", 1)
    body.setdefault("type", draw(st.sampled_from([*M.MESSAGE_TYPES, P.TX_START, "x"])))
    return [json.dumps(body).encode(), *draw(st.lists(st.binary(max_size=64), max_size=3))]


# --- The channel emulator as a process between real sockets (tests/emulator/test_channel_proxy.py) -----------------

class Bench:
    def __init__(self, tmp_path, mode="real"):
        self.ctx = zmq.Context()
        self.eps = {k: f"ipc://{tmp_path}/{k}" for k in ("front", "edge", "ctl")}
        self.proc = subprocess.Popen([sys.executable, "-m", "channel_emulator.proxy", "--frontend", self.eps["front"],
                                      "--edge", self.eps["edge"], "--control", self.eps["ctl"], "--mode", mode],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.control = ChannelControl(self.eps["ctl"], timeout_s=10, context=self.ctx)
        self.edge = self.sock(zmq.ROUTER)
        self.edge.bind(self.eps["edge"])
        self.devices = {}
        self.control.stats()

    def sock(self, kind):
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10_000)
        return s

    def device(self, name):
        s = self.sock(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, name.encode())
        s.connect(self.eps["front"])
        self.devices[name] = s
        s.send(encode_header({"type": "register"}))  # opens the emulator's DEALER for this identity
        ident, frame = self.edge.recv_multipart()
        assert ident == name.encode() and decode_header(frame)["type"] == "register"
        return s

    def alive(self):
        return self.proc.poll() is None

    def close(self):
        try:
            if self.alive():
                self.control.stop()
            self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()  # started by this test: ended by its handle
                self.proc.wait()
            for s in [self.edge, *self.devices.values()]:
                s.close(linger=0)
            self.control.close()
            self.ctx.term()


# --- Exact enumeration of the speculative-sampling output (tests/core/test_sampling.py, test_topk.py) --------------

def _intervals(breaks):
    b = np.unique(np.clip(np.concatenate([[0.0, 1.0], np.asarray(breaks, float)]), 0.0, 1.0))
    top = np.nextafter(1.0, 0.0)  # a midpoint of an interval of width ~1e-16 below 1 can round up to 1
    return [(min((lo + hi) / 2, top), hi - lo) for lo, hi in zip(b[:-1], b[1:]) if hi > lo]


def _cdf_breaks(w):
    w = np.maximum(np.asarray(w, float), 0)
    return np.cumsum(w) / w.sum()


def _code_token_dist(fn, weights_for_breaks):
    out: dict[int, float] = {}
    for mid, length in _intervals(_cdf_breaks(weights_for_breaks)):
        y = fn(mid)
        out[y] = out.get(y, 0.0) + length
    return out


def toy_model(vocab: int, seed: int, params: SamplingParams, peaky: float, tiny: bool = False):
    @functools.cache
    def dist(prefix: tuple) -> np.ndarray:
        r = np.random.default_rng([seed, len(prefix), *prefix])
        logits = r.normal(scale=peaky, size=vocab)
        if r.random() < 0.3:
            logits[r.integers(vocab)] = -np.inf  # exact zeros in some rows
        if tiny and r.random() < 0.7:
            logits[r.integers(vocab)] = np.max(logits) - 25  # ~1e-11: > 0, but 0 in float16
        return to_probs(np.where(np.isfinite(logits), logits, -1e300), params)
    return dist


def _round_outcomes(prefix, draft_len, p_model, q_model, q_verify_model=None):
    """Exact {(n_accepted, next_token, drafts): probability} of one round, through the code's functions.
    Drafts are sampled from q_model; accept/reject and correction use q_verify_model (default: the same)."""
    q_verify_model = q_verify_model or q_model
    out = {}

    def rec(drafts, prob):
        if len(drafts) == draft_len:
            q_rows = [q_verify_model(prefix + drafts[:i]) for i in range(draft_len)]
            p_rows = [p_model(prefix + drafts[:i]) for i in range(draft_len + 1)]
            reach = prob
            for j in range(draft_len + 1):
                if j == draft_len:
                    for y, w in _code_token_dist(lambda u, j=j: sample_from(p_rows[j], u), p_rows[j]).items():
                        out[(j, y, drafts)] = out.get((j, y, drafts), 0.0) + reach * w
                    break
                x = drafts[j]
                ratio = p_rows[j][x] / q_rows[j][x]
                acc = sum(l for mid, l in _intervals([ratio])
                          if count_accepted([x], [q_rows[j][x]], [p_rows[j][x]], [mid]) == 1)
                resid = np.maximum(0, p_rows[j] - q_rows[j])
                if reach * (1 - acc) > 0:
                    corr = _code_token_dist(lambda u, j=j: sample_correction(p_rows[j], q_rows[j], u), resid)
                    for y, w in corr.items():
                        out[(j, y, drafts)] = out.get((j, y, drafts), 0.0) + reach * (1 - acc) * w
                reach *= acc
            return
        q = q_model(prefix + drafts)
        for x, w in _code_token_dist(lambda u: sample_from(q, u), q).items():
            rec(drafts + (x,), prob * w)

    rec((), 1.0)
    return out


def output_and_target(vocab, draft_len, p_model, q_model, q_verify_model=None):
    """Exact distributions of the first draft_len + 1 output tokens: the code's, and the target p_model's."""
    n = draft_len + 1

    @functools.cache
    def generated(prefix: tuple, remaining: int) -> dict:
        if remaining == 0:
            return {(): 1.0}
        out: dict[tuple, float] = {}
        for (j, y, drafts), w in _round_outcomes(prefix, draft_len, p_model, q_model, q_verify_model).items():
            if w == 0:
                continue
            emitted = (drafts[:j] + (y,))[:remaining]
            for tail, w2 in generated(prefix + emitted, remaining - len(emitted)).items():
                out[emitted + tail] = out.get(emitted + tail, 0.0) + w * w2
        return out

    got = generated((), n)
    target: dict[tuple, float] = {}

    def rec(seq, prob):
        if len(seq) == n:
            target[seq] = prob
            return
        p = p_model(seq)
        for x in range(vocab):
            if p[x] > 0:
                rec(seq + (x,), prob * p[x])

    rec((), 1.0)
    return got, target


# --- Synthetic round records (tests/run/test_workflow.py, tests/analysis/test_workflow_output.py) ------------------

SCEN = {"bits_per_prob": 16, "max_draft_len": 6,
        "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.01, "acceptance": 0.7},
                    {"name": "b", "distance_m": 300, "draft_time_s": 0.02, "acceptance": 0.6}]}


def synth_records(n: int, policy: str = "proposed", slow: float = 1.5, slow_verify: float = 1.0) -> list[dict]:
    """n round records of two devices; the measured round is `slow` times the predicted one, the measured
    verification `slow_verify` times the predicted one."""
    c = Controller(load_scenario({**SCEN, "vocab_size": 1000}))
    recs = []
    for r in range(n):
        rp = c.plan_round(r, ["a", "b"])
        outcomes = {}
        for name in ("a", "b"):
            d = rp.per_device[name]
            outcomes[name] = DeviceOutcome(
                n_accepted=1, tokens=2, dl_payload="p", ul_bytes=10, dl_bytes=10, up_phase_s=d.uplink_s * 1.1,
                t_verdict=0.0, timings={"draft_s": d.draft_s * 1.1},
                ul_channel={"mode": "real", "held_s": d.tx_s * 1.02, "bytes": 10},
                dl_channel={"mode": "real", "held_s": d.downlink_s * 0.98, "bytes": 10})
        recs.append(round_record(rp, policy=policy, outcomes=outcomes,
                                 verify_s=rp.plan["phases_s"]["verify"] * slow_verify,
                                 round_s=rp.plan["round_time_s"] * slow, t_start_s=float(r)))
    return recs
