"""A live run in two halves: `build_session` loads everything a run needs (tokenizer, target, scenario,
hardware, channel state, controller, prompts) without starting anything; `run_session` starts the edge,
the channel emulator and the devices, runs the rounds and writes the run directory.

`testbed.run.live.run_live` is the one call that does both. Run directory (see `testbed.runtime.records`):
meta.json (status running -> complete | incomplete | interrupted | failed, with the reason and the exit
codes of the processes), rounds.jsonl, progress.jsonl, outputs.json, summary.json (every run, with its
status), logs/<process>.log.

Statuses: ``complete`` (every round ran, or every session finished), ``degraded`` (complete, but rounds fell
back: summary.json's ``fallbacks`` counts them per kind), ``incomplete`` (every device left before the last
round), ``interrupted`` (Ctrl-C, SIGTERM, SIGHUP), ``failed`` (an error; the reason says which; a plug-in
that raised: ``plugin_failure`` names it, the round and the error, its traceback in logs/plugin_error.log).
`load_resume` + ``run_live(..., resume=...)`` continue an interrupted run in its own directory.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq

from channel_emulator.proxy import ChannelControl
from device_node.hardware import HardwareProfile, load_hardware
from edge_node.controller import Controller
from edge_node.server import EdgeConfig, EdgeServer
from edge_node.verifier import BatchedVerifier, load_target
from testbed.analysis import report
from testbed.core import payload
from testbed.core.scenario import Scenario
from testbed.run.deadline import adapt_deadline
from testbed.run.launcher import (
    COMPLETE,
    FAILED,
    INCOMPLETE,
    Launcher,
    check_ports_free,
    interrupt_signals,
    load_tokenizer,
    port_in_use,
    raise_if_interrupted,
    status_of,
    tcp_port,
)
from testbed.run.planning import add_expected_goodput
from testbed.run.profile import Profile, ProfileError, load_profile
from testbed.runtime.errors import TestbedError
from testbed.runtime.heap import keep_freed_memory
from testbed.runtime.plugins import PluginFailure
from testbed.runtime.processes import how_it_exited, pid_alive
from testbed.runtime.records import RunRecorder, iter_rounds, load_progress, read_meta
from testbed.runtime.security import EDGE_CLIENT, ClientKeys, SecurityError, ServerKeys, require_keys_or_insecure
from testbed.runtime.waiting import busy_poll_wanted

log = logging.getLogger("multispin.session")
# A run that completed with rounds planned by a fallback (summary.json `fallbacks`): done, like complete.
DEGRADED = "degraded"
FINISHED = (COMPLETE, DEGRADED)


@dataclass
class Resume:
    """Where an interrupted run goes on from (`load_resume`)."""

    run_dir: Path
    start_round: int  # the first round to run: the last recorded round + 1
    prior: dict[str, dict]  # device -> output_ids, rounds, accepted, drafted generated so far
    previous_status: str | None


@dataclass
class LiveSession:
    """One live run: what `build_session` loaded, then what `run_session` started (None until then)."""

    profile: Profile
    run_dir: Path
    pair: dict  # paths of target, draft_onnx, tokenizer (see launcher.resolve_pair)
    tokenizer: Any  # tokenizers.Tokenizer
    verifier: BatchedVerifier
    scenario: Scenario
    hardware: dict[str, HardwareProfile]  # per device name
    controller: Controller
    texts: list[str]  # the prompts as text ...
    prompts: list[list[int]]  # ... and as token ids
    start_devices: bool  # start one device process per scenario device here
    bind: str | None  # the edge endpoint; None: the profile's, else a private ipc:// socket
    resume: Resume | None = None
    request_prompts: list[list[int]] | None = None  # `requests:`: the prompt set's token ids
    # -- while running --
    recorder: RunRecorder | None = None
    launcher: Launcher | None = None
    tmp: Path | None = None  # private folder of the ipc:// sockets
    server: EdgeServer | None = None
    channel: ChannelControl | None = None
    outputs: dict[str, dict] = field(default_factory=dict)  # latest progress per device (progress.jsonl)
    failure: dict | None = None  # a plug-in that raised (`PluginFailure.as_dict`): meta and summary keep it
    pool: Any = None  # `testbed.run.warm.WarmPool`: the target and processes shared with other trials
    warm: bool = False  # this trial runs on the pool's processes (started by an earlier trial)
    say: Any = None  # callable(text): the start phases, as they begin (`progress`)
    t_start: float = 0.0  # when the run opened (monotonic): the start phases count from it

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.scenario.devices]

    @property
    def vocab(self) -> int:
        return self.verifier.vocab_size

    @property
    def busy_poll(self) -> bool:
        """Whether the edge and the device processes started here busy-poll (`profile.busy_poll`). auto: only when
        the run starts its devices here (then it knows every process on this machine) and the edge, the
        emulator and the device processes have a core each, and not while the edge measures its links (a
        spinning edge takes the core the kernel's network stack needs for them: a tbf-limited 40 Mbit/s link
        read 54 Mbit/s)."""
        p = self.profile
        if p.busy_poll == "auto" and (not self.start_devices or p.channel.measure_links):
            return False
        device_processes = -(-len(self.names) // p.devices_per_process) if self.start_devices else 0
        return busy_poll_wanted(p.busy_poll, 1 + (p.channel.mode != "passthrough") + device_processes)

    @property
    def start_round(self) -> int:
        return self.resume.start_round if self.resume else 0


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- building -------------------------------------------------------------------------------------------

def build_session(profile: Profile, run_dir: Path, pair: dict, *, start_devices: bool | None = None,
                  bind: str | None = None, resume: Resume | None = None, pool=None) -> LiveSession:
    """Load the pair and everything derived from the profile; starts no process and opens no socket. With a
    `pool` (`testbed.run.warm.WarmPool`) the target and tokenizer loaded for an earlier trial are reused."""
    texts = profile.prompt_list()

    def target() -> BatchedVerifier:
        return BatchedVerifier(load_target(pair["target"], device=profile.model.device, dtype=profile.model.dtype),
                               device=profile.model.device, threads=profile.model.threads)

    if pool is not None:
        tokenizer, verifier = pool.tokenizer_and_verifier(profile, pair, target)
        prompts = encode_prompts(tokenizer, texts)
    else:
        tokenizer = load_tokenizer(pair["tokenizer"])
        prompts = encode_prompts(tokenizer, texts)  # before the (slow) target: a bad prompt fails at once
        verifier = target()
    vocab = verifier.vocab_size
    if profile.on_air_vocab_size and profile.on_air_vocab_size < vocab:
        raise TestbedError(f"on_air_vocab_size: {profile.on_air_vocab_size} is smaller than the model's "
                           f"vocabulary {vocab}")
    scenario = profile.scenario_obj(vocab)
    too_big = [k for k in payload.options(scenario) if k is not None and k > vocab]
    if too_big:  # a top-k upload sends k distinct ids of the model's vocabulary
        raise TestbedError(f"scenario: top-k k={too_big[0]} (topk_k / topk_choices) exceeds the model's vocabulary "
                           f"{vocab}; use k <= {vocab}")
    hardware = load_device_hardware(profile, [d.name for d in scenario.devices])
    request_prompts = None
    if profile.requests is not None:  # the prompt set read and encoded now: a bad one fails before anything runs
        from testbed.run.requests import load_prompt_set

        request_prompts = encode_prompts(tokenizer, load_prompt_set(profile.requests.prompts,
                                                                    profile.requests.prompt_field))
    if start_devices is None:
        start_devices = profile.start_devices and profile.deployment == "emulation"
    return LiveSession(profile=profile, run_dir=Path(run_dir), pair=pair, tokenizer=tokenizer, verifier=verifier,
                       scenario=scenario, hardware=hardware, controller=make_controller(profile, scenario, hardware),
                       texts=texts, prompts=prompts, start_devices=start_devices, bind=bind, resume=resume,
                       request_prompts=request_prompts, pool=pool)


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    prompts = []
    for t in texts:
        ids = tokenizer.encode(t).ids
        if not ids:
            raise TestbedError(f"prompt {t!r} encodes to no tokens")
        prompts.append(ids)
    return prompts


def load_device_hardware(profile: Profile, names: list[str]) -> dict[str, HardwareProfile]:
    try:
        return {n: load_hardware(profile.hardware.get(n)) for n in names}
    except ValueError as exc:  # an unknown hardware name or a bad YAML: the message says which
        raise TestbedError(str(exc)) from None


def make_controller(profile: Profile, scenario: Scenario, hardware: dict[str, HardwareProfile]) -> Controller:
    """The run's controller (`testbed.run.planning.make_controller`: `multispin plan` builds the same one)."""
    from testbed.run.planning import make_controller as planning_controller

    return planning_controller(profile, scenario, {n: h.compute_scale for n, h in hardware.items()})


# --- resuming -------------------------------------------------------------------------------------------

def load_resume(run_dir: str | Path) -> tuple[Profile, Resume]:
    """The profile snapshot of an interrupted run and where to go on from; a TestbedError says why a run
    directory cannot be resumed (not one, complete, still running, every round recorded)."""
    run_dir = Path(run_dir)
    what = f"--resume {run_dir}"
    meta = read_meta(run_dir, what)
    status = meta.get("status")
    if status in FINISHED:
        raise TestbedError(f"{what}: the run is {status}; nothing to resume")
    pid = meta.get("pid")
    if status == "running" and meta.get("host") == platform.node() and isinstance(pid, int) and pid_alive(pid):
        raise TestbedError(f"{what}: the run is still running (pid {pid})")
    try:
        profile = load_profile(meta["profile"])
    except (KeyError, TypeError):
        raise TestbedError(f"{what}: meta.json holds no profile snapshot") from None
    except ProfileError as exc:
        raise TestbedError(f"{what}: its profile snapshot no longer loads: {exc}") from None
    last = None
    if (run_dir / "rounds.jsonl").is_file():
        for rec in iter_rounds(run_dir):
            if isinstance(rec.get("round"), int):
                last = rec["round"]
    if profile.requests is not None:  # the requests' queues and clocks are not recovered
        raise TestbedError(f"{what}: a run that served requests cannot be resumed; start a new run")
    if profile.scenario.get("rounds") == "asynchronous":  # per-device cycle counts are not recovered
        raise TestbedError(f"{what}: a run with asynchronous rounds cannot be resumed; start a new run")
    start = 0 if last is None else last + 1
    if start >= profile.rounds:
        raise TestbedError(f"{what}: all {profile.rounds} rounds are recorded; nothing to resume")
    return profile, Resume(run_dir, start, _prior_outputs(run_dir), status)



def _prior_outputs(run_dir: Path) -> dict[str, dict]:
    """Token ids per device so far: the progress log (every round) or else outputs.json (end of the run)."""
    for read in (lambda: (load_progress(run_dir) or {}).get("devices"),
                 lambda: json.loads((run_dir / "outputs.json").read_text())):
        try:
            data = read()
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            return {n: {k: d.get(k, [] if k == "output_ids" else 0)
                        for k in ("output_ids", "rounds", "accepted", "drafted")}
                    for n, d in data.items() if isinstance(d, dict)}
    return {}


def edge_prompts(s: LiveSession) -> tuple[list[list[int]], list[str]]:
    """The prompts the edge hands out. Resumed: one per device in the order of the sorted names (the edge's
    round robin), each the device's prompt followed by what it generated before."""
    if s.resume is None:
        return s.prompts, s.texts
    prompts, texts = [], []
    for i, name in enumerate(sorted(s.names)):
        prior = s.resume.prior.get(name, {}).get("output_ids", [])
        prompts.append(list(s.prompts[i % len(s.prompts)]) + [int(t) for t in prior])
        texts.append(s.texts[i % len(s.texts)])
    return prompts, texts


# --- running --------------------------------------------------------------------------------------------

def run_session(s: LiveSession, *, progress: bool = True, on_round=None, recorder: RunRecorder | None = None) -> dict:
    """Start the processes, run the rounds, write the run directory and return the summary. Whatever
    happens (an error, Ctrl-C, SIGTERM), every process started is stopped and meta.json and summary.json
    say how the run ended."""
    status, reason, summary = FAILED, "stopped before its first round", None
    with interrupt_signals() as signals:
        open_run(s, recorder)
        try:
            check_endpoints(s)
            phase(s, "calibrating the verification")
            calibrate_verification(s)
            calibrate_topk(s)
            phase(s, "starting the edge")
            start_edge(s)
            phase(s, "the channel emulator")
            connect = start_channel(s)
            phase(s, "the devices")
            start_devices(s, connect)
            phase(s, f"waiting for {len(s.names)} device(s) to register")
            wait_for_devices(s)
            phase(s, "ready: round 0")
            record_calibration(s)
            adapt_deadline(s)  # a deadline the plan cannot meet: warned, adapted, recorded
            tally = run_rounds(s, progress, on_round)
            status, reason = outcome(s, tally)
            summary = finish(s, status, reason)
            status, reason = summary["status"], summary["reason"]  # complete may have become degraded
            return summary
        except BaseException as exc:  # Ctrl-C too: the run directory must not say "running" forever
            status, reason = status_of(exc)
            if isinstance(exc, PluginFailure):
                note_plugin_failure(s, exc)
            raise
        finally:
            signals.shield()  # a second signal must not cut the cleanup short
            close_run(s, status, reason, finished=summary is not None)


def open_run(s: LiveSession, recorder: RunRecorder | None = None) -> None:
    """The recorder, the process owner, the private socket folder, and meta.json (status running)."""
    s.recorder = recorder or RunRecorder(s.run_dir, sync_interval_s=s.profile.records_sync_interval_s)
    s.t_start = time.monotonic()
    if s.pool is not None:  # the processes of an earlier trial, or a cold start the pool keeps afterwards
        s.warm = s.pool.adopt(s)
    else:
        s.launcher = Launcher(s.run_dir / "logs")
        s.tmp = Path(tempfile.mkdtemp(prefix="ms-"))  # short paths: ipc:// names are limited to ~100 bytes
    p = s.profile
    fields = dict(channel_mode=p.channel.mode, model=s.pair, vocab_size=s.vocab, run_dir=str(s.run_dir),
                  hardware={n: h.to_dict() for n, h in s.hardware.items()}, status="running", pid=os.getpid(),
                  security="keys" if p.keys_dir else "insecure" if p.insecure else "loopback only",
                  target=s.verifier.describe())
    if s.pool is not None:  # which trial of its process, and whether it started its processes itself
        fields["warm"] = {"trial": s.pool.trials, "reused_processes": s.warm}
    meta = s.recorder.read_meta()
    if s.resume is not None:
        fields["resumed"] = [*meta.get("resumed", []), {"at_utc": _utc_now(),
                                                         "from_round": s.resume.start_round,
                                                         "previous_status": s.resume.previous_status}]
    if "profile" in meta:
        s.recorder.update_meta(**fields)
    else:
        s.recorder.write_meta(p.snapshot(), **fields)


def edge_endpoint(s: LiveSession) -> str:
    return s.bind or s.profile.endpoints.edge_bind or f"ipc://{s.tmp}/edge"


def channel_endpoints(s: LiveSession) -> tuple[str, str]:
    """(frontend, control) of the emulator."""
    ep = s.profile.endpoints
    return ep.channel_frontend or f"ipc://{s.tmp}/front", ep.channel_control or f"ipc://{s.tmp}/control"


def check_endpoints(s: LiveSession) -> None:
    """Before any socket: the security rule for what is exposed (keys, or `security: insecure`) and the
    ports to bind (a taken one is named, with the process holding it)."""
    p = s.profile
    binds = {"the edge's endpoint": edge_endpoint(s)}
    if p.channel.mode != "passthrough":
        front, control = channel_endpoints(s)
        binds.update({"endpoints.channel_frontend": front, "endpoints.channel_control": control})
    try:
        require_keys_or_insecure(list(binds.values()), p.keys_dir, p.insecure, "edge")
        if p.keys_dir:
            ServerKeys.load(p.keys_dir)  # a broken key directory is named now, not by a child process
            ClientKeys.for_name(p.keys_dir, EDGE_CLIENT)
    except SecurityError as exc:
        raise TestbedError(f"security: {exc}") from None
    check_ports_free(binds)


def calibrate_verification(s: LiveSession) -> None:
    """With `estimator.calibrate` (the default): time the target's verification at a few batch shapes before
    anything else runs (no device competes for the cores yet) and give the controller the fitted t0, t1, so
    that round 0 is planned on them (`edge_node.calibration`)."""
    if not s.profile.estimator.calibrate:
        return
    from edge_node.calibration import calibrate_verification as timed

    prompts, _ = edge_prompts(s)

    def measure() -> dict:
        return timed(s.verifier, len(s.names), s.scenario.max_draft_len, prompts, seed=s.profile.seed)

    if s.pool is not None:  # the same target on the same host: timed once per shape set
        key = (len(s.names), s.scenario.max_draft_len, tuple(map(tuple, prompts)))
        s.controller.calibrate_verify(dict(s.pool.calibration(key, measure)))
    else:
        s.controller.calibrate_verify(measure())


def calibrate_topk(s: LiveSession) -> None:
    """With `estimator.calibrate` and top-k options (`payload_format: topk`, `topk_choices`): measure alpha_k /
    alpha per k with the run's draft model and target on the devices' prompts before round 0, the prior of
    every k's acceptance (`edge_node.topk_calibration`)."""
    ks = [k for k in payload.options(s.scenario) if k is not None]
    if not s.profile.estimator.calibrate or not ks:
        return
    from device_node.drafter import OnnxDrafter
    from edge_node.topk_calibration import calibrate_topk_acceptance
    from testbed.core.sampling import SamplingParams

    prompts, _ = edge_prompts(s)
    try:  # the draft model on the edge's host: a LAN edge may not hold it
        drafter = OnnxDrafter(s.pair["draft_onnx"])
    except (KeyError, FileNotFoundError, ValueError) as exc:
        log.warning("top-k acceptance not calibrated (%s): the scenario's topk_acceptance_ratio is the prior", exc)
        s.controller.calibration["topk"] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    s.controller.calibrate_topk(calibrate_topk_acceptance(
        drafter, s.verifier, prompts[:max(1, min(len(prompts), len(s.names)))], ks,
        SamplingParams(**s.profile.sampling.model_dump()), draft_len=s.scenario.max_draft_len, seed=s.profile.seed))


def calibration_entry(s: LiveSession) -> dict | None:
    """meta.json's and summary.json's `calibration`: per device its drafting time as it timed itself (null:
    it sent none), the verification's t0, t1, the shapes timed and the seconds they took; None without
    `estimator.calibrate`."""
    if not s.profile.estimator.calibrate:
        return None
    cal = s.controller.calibration
    v = cal.get("verify") or {}
    return {"draft_time_s": {n: cal["draft_time_s"].get(n) for n in s.names},
            "verify_t0_s": v.get("verify_t0_s"), "verify_t1_s": v.get("verify_t1_s"), "fit": v.get("fit"),
            "shapes": v.get("shapes"), "took_s": v.get("took_s"), "topk": cal.get("topk")}


def record_calibration(s: LiveSession) -> None:
    """The calibration in meta.json, once the devices registered (each sent its drafting time then)."""
    entry = calibration_entry(s)
    if entry is not None:
        s.recorder.update_meta(calibration=entry)


def start_edge(s: LiveSession) -> None:
    p = s.profile
    keep_freed_memory()  # the edge plans every round (`testbed.runtime.heap`): every live run comes through here
    bind = edge_endpoint(s)
    prompts, texts = edge_prompts(s)
    try:
        config = EdgeConfig.from_profile(p, vocab_size=s.vocab, prompt_texts=texts, busy_poll=s.busy_poll)
        s.server = EdgeServer(bind, s.verifier, scenario=s.scenario, controller=s.controller, prompts=prompts,
                              config=config, recorder=s.recorder)
    except zmq.ZMQError as exc:  # a port taken since check_endpoints, or an address not of this host
        hp = tcp_port(bind)
        if exc.errno == zmq.EADDRINUSE and hp is not None:
            raise port_in_use("the edge's endpoint", bind, hp[1]) from None
        raise TestbedError(f"the edge's endpoint {bind}: {exc}") from None
    if p.requests is not None:  # before any device registers: each idles until its first request
        from testbed.run.requests import request_queues

        s.server.requests = request_queues(p.requests, s.names, s.request_prompts, p.seed,
                                           write=s.recorder.append_request)
    # A signal whose exception was swallowed still ends the run: the edge ticks in every wait, between
    # rounds too.
    s.server.check_stop = raise_if_interrupted


def start_channel(s: LiveSession) -> str:
    """Start the channel emulator between devices and edge (unless passthrough); returns where devices
    connect: its frontend, or the edge itself."""
    p, ep = s.profile, s.profile.endpoints
    if p.channel.mode == "passthrough":
        return s.server.endpoint
    front, control = channel_endpoints(s)
    if s.warm:  # the pool's emulator, as a fresh one: statistics, counters and links reset
        s.channel.reset()
        s.server.channel = s.channel
        s.server.channel_exited = lambda: channel_exited(s)
        return front
    # A wildcard bind is no address to connect to; on this host it is the loopback.
    edge = s.server.endpoint.replace("0.0.0.0", "127.0.0.1")
    # Only this process may reconfigure or stop the emulator: a fresh secret per run, handed over in the
    # child's environment (with keys, CURVE admits only the edge's key to the control socket as well).
    token = secrets.token_hex(16)
    proc = s.launcher.start_channel(front, edge, control, p.channel.mode, p.channel.spin_s, token=token,
                                    keys_dir=p.keys_dir, expect_devices=s.scenario.num_devices)
    keys = ClientKeys.for_name(p.keys_dir, EDGE_CLIENT) if p.keys_dir else None
    # `gone`: an emulator killed while a request waits ends the wait at once, not after 10 s.
    s.channel = ChannelControl(control, timeout_s=10.0, keys=keys, token=token, gone=lambda: channel_exited(s))
    try:
        s.channel.stats()  # waits until the emulator answers
    except (TimeoutError, RuntimeError) as exc:
        said = f"; it exited ({proc.returncode}): {s.launcher.last_line('channel')}" if proc.poll() is not None else ""
        raise TestbedError(f"channel emulator: {exc}{said} (log: {s.run_dir / 'logs' / 'channel.log'})") from None
    s.server.channel = s.channel
    s.server.channel_exited = lambda: channel_exited(s)  # polled each edge tick: a dead emulator ends the run
    if s.start_devices:
        return front.replace("0.0.0.0", "127.0.0.1")
    return ep.device_connect or front


def channel_exited(s: LiveSession) -> str | None:
    """Why the emulator this run started is gone ("exited (killed by SIGKILL, pid N): its last log line
    (log: ...)"), or None while it runs; `Popen.poll` only, cheap enough for every edge tick."""
    proc = s.launcher.procs.get("channel") if s.launcher is not None else None
    how = None if proc is None else how_it_exited(proc)
    if how is None:
        return None
    # It stopped itself: its last words say why (a killed one's are whatever it did last).
    last = s.launcher.last_line("channel") if proc.returncode > 0 else ""
    return f"exited ({how}, pid {proc.pid}){': ' + last if last else ''} (log: {s.run_dir / 'logs' / 'channel.log'})"


def channel_down(s: LiveSession) -> str | None:
    """Why the emulator is known dead (exited, or a control request timed out), or None: then no request
    is sent to it, which would only wait out its timeout."""
    return (s.server.channel_down if s.server is not None else None) or channel_exited(s)


def start_devices(s: LiveSession, connect: str) -> None:
    s.launcher.device_connect = connect  # on_round callbacks start replacement devices there
    s.launcher.keys_dir = s.profile.keys_dir
    s.launcher.busy_poll = s.busy_poll and s.profile.devices_per_process == 1  # a shared process never spins
    if s.warm:  # the pool's device processes wait for this: their devices register again
        s.pool.signal_next_run()
    elif s.start_devices:
        s.launcher.start_devices(connect, s.pair["draft_onnx"], device_specs(s),
                                 per_process=s.profile.devices_per_process)
    # What to look for if this process is killed; which process runs which device.
    s.recorder.update_meta(pids=s.launcher.pids(), device_processes=dict(s.launcher.device_procs),
                           busy_poll=s.busy_poll)


def device_specs(s: LiveSession) -> list[dict]:
    """Per device: its name, hardware profile and link probe (`hardware.<name>`, `link_probe.<name>`)."""
    p = s.profile
    return [{"name": n, "hardware": p.hardware.get(n), "link_probe": p.link_probe.get(n, "none"),
             "link_probe_period_s": p.link_probe_period_s} for n in s.names]


def wait_for_devices(s: LiveSession) -> None:
    """Wait for the devices to register; go on without some, but not without all. Stops waiting early when
    every missing device's process has exited (a bad model file, a refused registration)."""
    wait_s = s.profile.wait_for_devices_s
    deadline = time.monotonic() + wait_s
    # Fatal errors devices sent the edge (e.g. "cannot load its model"): name -> reason, if the edge keeps them.
    told = s.server.device_errors
    registered = 0
    while True:
        missing = s.server.wait_for_devices(s.names, max(0.0, min(1.0, deadline - time.monotonic())))
        if not missing or time.monotonic() >= deadline:
            break
        if len(s.names) - len(missing) != registered:  # the start phase's progress, each second
            registered = len(s.names) - len(missing)
            phase(s, f"{registered}/{len(s.names)} device(s) registered")
        procs = s.launcher.procs
        if all(n in told or (s.start_devices and procs[s.launcher.device_label(n)].poll() is not None)
               for n in missing):
            break  # nobody left who could still register
    if not missing:
        return
    failed = exited_devices(s.launcher)
    detail = ""
    if failed:
        detail = f"; exited: {'; '.join(failed)} (logs in {s.run_dir / 'logs'})"
    elif any(n in told for n in missing):
        detail = "; " + "; ".join(f"{n}: {told[n]}" for n in missing if n in told)
    if len(missing) == len(s.names):
        raise TestbedError(f"no device registered within {wait_s:g} s{detail}")
    log.warning("devices %s did not register; running without them%s", missing, detail)


def exited_devices(launcher: Launcher) -> list[str]:
    """One entry per process that exited with a non-zero status, with its last log line; a host process of
    several devices (`devices_per_process`) names each of its devices."""
    by_label: dict[str, list[str]] = {}
    for name, (label, _) in launcher.device_failures().items():
        by_label.setdefault(label, []).append(name)
    codes = launcher.failed()
    out = [f"{label} (status {c}: {launcher.last_line(label)})" for label, c in codes.items()
           if label not in launcher.device_procs.values()]  # the emulator, say
    for label, names in by_label.items():
        said = f"status {codes[label]}: {launcher.last_line(label)}"
        out.append(f"{label} ({said})" if names == [label.removeprefix("device-")] else
                   f"devices {', '.join(names)} (in {label}, {said})")
    return out


@dataclass
class RoundTally:
    """What the run loop leaves in memory of its records (they are in rounds.jsonl): how many, the latest."""

    count: int = 0
    last: dict | None = None


def run_rounds(s: LiveSession, progress: bool, on_round) -> RoundTally:
    """The profile's rounds, with a progress bar (round, tokens, measured and predicted goodput); with each
    round, just before its record, the progress log gets every device's tokens so far (what a resumed run
    continues from). Records
    are not kept in memory past their write: a long run's edge stays flat."""
    bar = None
    if progress:
        from tqdm import tqdm

        cycles = s.scenario.rounds == "asynchronous"  # one record per device cycle: `rounds` cycles each
        bar = tqdm(total=s.profile.rounds * (len(s.names) if cycles else 1), initial=s.start_round,
                   unit="cycle" if cycles else "round",
                   desc=f"{s.profile.name} [{s.profile.policy}]")
    tokens = 0
    tally = RoundTally()

    def _on_round(rec: dict) -> None:
        nonlocal tokens
        tokens += rec["measured"]["tokens"]
        tally.count, tally.last = tally.count + 1, rec
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(progress_postfix(rec, tokens), refresh=False)
        if on_round is not None:
            on_round(rec, s.server, s.launcher)

    # Each round's progress line just before its record (`EdgeServer.before_record`).
    s.server.before_record = lambda rec: save_progress(s, rec.get("round"))
    try:
        run_from(s.server, s.start_round, s.profile.rounds, _on_round)
        return tally
    finally:
        if bar is not None:
            bar.close()


def progress_postfix(rec: dict, tokens: int) -> str:
    """The progress bar's text after a round: that round's goodput (not the run's), with units."""
    what = "cycle" if rec.get("rounds") == "asynchronous" else "round"  # one device's cycle
    meas, pred = rec["measured"].get("goodput_tps"), rec["predicted"].get("goodput_tps")
    return (f"{what} goodput {meas or 0:.1f} meas / {pred or 0:.1f} pred tok/s, {tokens} tok, "
            f"{rec.get('num_ul', 0)} UL")


def run_from(server: EdgeServer, start: int, rounds: int, on_round) -> None:
    """Rounds `start`..`rounds`-1 (round indices seed every random draw, so a resumed run numbers on)."""
    server.run(rounds, on_round=on_round, start_round=start, keep_records=False)


def outcome(s: LiveSession, tally: RoundTally) -> tuple[str, str]:
    """(status, reason) of a run whose loop ended normally."""
    rounds, n = s.profile.rounds, tally.count
    queues = s.server.requests
    if queues is not None and (queues.all_done or s.server.sessions):
        served = queues.finished
        left = sum(len(q) for q in queues.waiting.values()) + len(queues.serving)
        if queues.all_done:
            return COMPLETE, f"every request served ({served} requests, {n} rounds)"
        ran_out = tally.last is not None and tally.last["round"] + 1 >= rounds
        why = "the rounds ran out" if ran_out else "their devices left"
        return COMPLETE, f"{served} requests served, {left} not ({why}; requests.jsonl has each)"
    if s.scenario.rounds == "asynchronous" and n:  # `round` counts the cycles of all devices
        if s.server.sessions and all(x.done for x in s.server.sessions.values()):
            return COMPLETE, f"every device session finished (max_new_tokens) after {n} cycles"
        if s.server.sessions:
            return COMPLETE, f"up to {rounds} cycles per device (asynchronous rounds; {n} cycles)"
        return INCOMPLETE, f"every device left the run after {n} cycles (asynchronous rounds)"
    last = tally.last["round"] if tally.last else s.start_round - 1
    if last + 1 >= rounds:
        return COMPLETE, f"{rounds} rounds"
    sessions = s.server.sessions
    if any(not x.done for x in sessions.values()):
        return COMPLETE, f"{rounds} rounds (the last after round {last} without a device ready to draft)"
    if sessions:
        return COMPLETE, f"every device session finished (max_new_tokens) by round {last}"
    return INCOMPLETE, (f"every device left the run after round {last}; rounds {last + 1}..{rounds - 1} not run "
                        f"(see the device logs and the edge's messages)")


def note_plugin_failure(s: LiveSession, exc: PluginFailure) -> None:
    """A plug-in raised: keep what failed for meta.json and summary.json, its traceback in logs/."""
    s.failure = exc.as_dict()
    try:
        (s.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (s.run_dir / "logs" / "plugin_error.log").write_text(f"{exc}\n\n{exc.traceback}")
    except OSError as err:
        log.error("while stopping the run (logs/plugin_error.log): %s", err)


def degraded(status: str, reason: str, summary: dict) -> tuple[str, str]:
    """A complete run some of whose rounds fell back (`fallbacks` of the summary) is `degraded`, the reason
    saying how many rounds and why."""
    fb = summary.get("fallbacks") or {}
    if status != COMPLETE or not fb.get("rounds"):
        return status, reason
    kinds = ", ".join(f"{k} {n}" for k, n in (fb.get("by_kind") or {}).items())
    return DEGRADED, f"{reason}; {fb['rounds']} of {summary.get('rounds')} rounds fell back ({kinds})"


def finish(s: LiveSession, status: str, reason: str) -> dict:
    """End the device sessions; write outputs.json and summary.json (from rounds.jsonl: the whole run, a
    resumed one's earlier part too); returns the summary."""
    if s.server.requests is not None:
        s.server.requests.close()  # those not finished are recorded as such
    outputs = session_outputs(s, s.server.finish("run complete" if status == COMPLETE else f"run {status}"))
    if status != COMPLETE and s.outputs:
        # A run that did not complete keeps the tokens of its recorded rounds: a resume reruns the round in
        # flight, so what that round committed (verdicts out, record not yet written) is not the run's.
        kept = interrupted_outputs(s.run_dir, s.outputs)
        outputs.update({n: {**e, "text": s.tokenizer.decode(e["output_ids"])} for n, e in kept.items()})
    s.recorder.write_outputs(outputs)
    written = (s.run_dir / "rounds.jsonl").is_file()
    records = list(iter_rounds(s.run_dir)) if written else []
    # Under a fading channel: the run's expected goodput over the channel's draws (testbed.run.planning).
    summary = add_expected_goodput(report.summarize(records), s.profile, records, vocab_size=s.vocab)
    status, reason = degraded(status, reason, summary)
    summary.update(status=status, reason=reason, rounds_requested=s.profile.rounds,
                   refused_messages=s.server.refused, refusals=dict(s.server.refusals))
    add_serving(summary, s)
    if (calibration := calibration_entry(s)) is not None:
        summary["calibration"] = calibration
    if s.channel is not None and not channel_down(s):
        try:
            summary["channel_stats"] = s.channel.stats()
            if s.pool is None:  # a pool's emulator serves the next trial, or the pool stops it
                s.channel.stop()
                s.launcher.leaving.add("channel")
        except (TimeoutError, RuntimeError) as exc:
            log.warning("channel emulator: %s", exc)
    s.recorder.write_summary(summary)
    return summary


def add_serving(summary: dict, s: LiveSession) -> None:
    """summary.json's `serving` (`testbed.analysis.serving`) from requests.jsonl, for a run that served requests."""
    if s.profile.requests is None:
        return
    from testbed.analysis import serving
    from testbed.runtime.records import load_requests

    summary["serving"] = serving.summarize(load_requests(s.run_dir))
    summary["serving_settings"] = s.profile.requests.model_dump(mode="json")


def interrupted_outputs(run_dir: Path, in_memory: dict[str, dict]) -> dict[str, dict]:
    """The tokens per device of a run that did not complete: the progress log as written (what `--resume`
    starts from), else `in_memory`. A signal between a round's progress update in memory and its line on disk
    left the memory a round ahead of the file, and outputs.json then held tokens the resumed run regenerated
    differently (test_a_signal_ends_the_run_cleanly_and_resume_goes_on, once in a full run)."""
    on_disk = (load_progress(run_dir) or {}).get("devices")
    if not isinstance(on_disk, dict) or not on_disk:
        return in_memory
    return {n: {**in_memory.get(n, {}), **e} for n, e in on_disk.items() if isinstance(e, dict)}


def save_progress(s: LiveSession, round_index: int | None) -> None:
    """The progress log (progress.jsonl): every device's tokens so far (a device that left keeps its last
    entry); the recorder writes what changed since the last round."""
    s.outputs.update(session_outputs(s, s.server.sessions, text=False))
    s.recorder.write_progress({"round": round_index, "devices": s.outputs})


def session_outputs(s: LiveSession, sessions: dict, *, text: bool = True) -> dict:
    """outputs.json: per device, its prompt, the generated ids and text, and its acceptance; a resumed run
    counts what the device generated before the interruption too."""
    out = {}
    order = sorted(s.names)
    prior_all = s.resume.prior if s.resume else {}
    for n, x in sessions.items():
        # The edge hands out prompts in the order of the sorted device names, round robin.
        i = order.index(n) if n in order else 0
        prior = prior_all.get(n, {})
        ids = [int(t) for t in prior.get("output_ids", [])] + list(x.output_ids)
        entry = {"session": x.sid, "prompt": s.texts[i % len(s.texts)],
                 "prompt_tokens": len(s.prompts[i % len(s.prompts)]), "output_tokens": len(ids), "output_ids": ids,
                 "rounds": prior.get("rounds", 0) + x.rounds,
                 "accepted": prior.get("accepted", 0) + x.accepted, "drafted": prior.get("drafted", 0) + x.drafted,
                 "hardware": x.hardware, "clock": getattr(x, "clock", None)}  # its clock's offset to the edge's
        entry["acceptance"] = entry["accepted"] / entry["drafted"] if entry["drafted"] else None
        if s.profile.requests is not None:  # serving requests: the device's latest request (requests.jsonl: all)
            entry["prompt_tokens"] = len(x.prompt_ids)
            entry["prompt"] = s.tokenizer.decode(list(x.prompt_ids))
        if text:
            entry["text"] = s.tokenizer.decode(ids)
        out[n] = entry
    if text:  # a device of the interrupted run that did not come back keeps what it had generated
        for n, prior in prior_all.items():
            if n not in out and n in order:
                i = order.index(n)
                ids = [int(t) for t in prior.get("output_ids", [])]
                out[n] = {"session": None, "prompt": s.texts[i % len(s.texts)],
                          "prompt_tokens": len(s.prompts[i % len(s.prompts)]), "output_tokens": len(ids),
                          "output_ids": ids, "text": s.tokenizer.decode(ids), "rounds": prior.get("rounds", 0),
                          "accepted": prior.get("accepted", 0), "drafted": prior.get("drafted", 0),
                          "acceptance": None, "hardware": None}
    return out


def abort_run(s: LiveSession, status: str, reason: str) -> None:
    """Best effort for a run that stopped early: keep the last round's record, tell the devices, and write
    outputs.json and summary.json from what is on disk. Logs what fails; never raises."""
    if s.server is not None:  # each round's record is already on disk: it is written as the round ends
        try:
            s.recorder.write_outputs(session_outputs(s, s.server.finish(f"run {status}: {reason}")))
        except Exception as exc:  # the disk that stopped the run may refuse this too
            stop_error(reason, "outputs", exc)
    summary: dict = {}
    try:
        summary = report.summarize(list(iter_rounds(s.run_dir)))
        summary["rounds_requested"] = s.profile.rounds
        if s.failure is not None:
            summary["plugin_failure"] = s.failure
        if s.server is not None:
            summary["refused_messages"] = s.server.refused
            summary["refusals"] = dict(s.server.refusals)
            if s.server.requests is not None:
                s.server.requests.close()
                add_serving(summary, s)
    except Exception as exc:
        stop_error(reason, "summary", exc)
    # An emulator known dead (the reason the run stopped, perhaps) has none: asking would wait out a timeout.
    if s.channel is not None and not channel_down(s):
        try:
            summary["channel_stats"] = s.channel.stats()
        except Exception as exc:  # best effort while stopping: nothing here may hide why the run stopped
            log.warning("channel emulator stats: %s", exc)
    s.recorder.end_run(status, reason, summary, **({"plugin_failure": s.failure} if s.failure else {}))


def stop_error(reason: str, what: str, exc: BaseException) -> None:
    """A write that failed while stopping the run: the error that stopped it (a full disk refusing these writes
    too) is said once, by the command's error line, so the same error again is logged at INFO; another at ERROR."""
    log.log(logging.INFO if str(exc) in reason else logging.ERROR, "while stopping the run (%s): %s", what, exc)


def close_run(s: LiveSession, status: str, reason: str, finished: bool) -> None:
    """Stop the run: for one that did not finish, `abort_run`; then close the sockets, stop every process
    started (their exit codes go to meta.json with the status), remove the socket folder."""
    try:
        if not finished:
            abort_run(s, status, reason)
    finally:
        if s.server is not None:
            s.server.close()
        if s.pool is not None and s.pool.keep(s, finished):  # the next trial's: still running
            codes = {label: None for label in s.launcher.procs}
        else:
            codes = stop_processes(s, finished)
        if s.pool is not None:  # this trial's part of the pool's process logs, into its logs/
            s.pool.copy_logs(s)
        try:
            s.recorder.update_meta(processes=codes, status=status, reason=reason,
                                   ended_utc=_utc_now())
        except TestbedError as exc:
            stop_error(reason, "meta.json", exc)
        s.recorder.close()
        if s.tmp is not None and (s.pool is None or s.tmp != s.pool.tmp):
            shutil.rmtree(s.tmp, ignore_errors=True)
        if status != COMPLETE:  # the command says it in its one line (`multispin run: error: ...`): INFO here
            log.info("run %s: %s (%s)", status, reason, s.run_dir)


def stop_processes(s: LiveSession, finished: bool) -> dict:
    """Stop the emulator and every process the run started; their exit statuses."""
    if s.pool is not None and s.channel is not None and not channel_down(s):
        try:  # a pool's emulator was not stopped at the end of the run (`finish`)
            s.channel.stop()
            s.launcher.leaving.add("channel")
        except (TimeoutError, RuntimeError) as exc:
            log.warning("channel emulator: %s", exc)
    if s.channel is not None:
        s.channel.close()
    # Devices here reach the edge through the emulator: with it dead no bye reaches them, so no waiting
    # (a finished run stopped its emulator itself, after the bye); a warm pool's devices wait for the next run
    # after the bye instead of leaving.
    quick = (not finished and channel_down(s)) or s.launcher.serve_runs
    return s.launcher.stop_all(grace_s=0.0 if quick else 5.0)


def phase(s: LiveSession, text: str) -> None:
    """A start phase as it begins, with the seconds since the run opened (`say`, with `progress`)."""
    if s.say is not None:
        s.say(f"start {time.monotonic() - s.t_start:5.1f} s: {text}")
