"""Starting and stopping the processes of a run, and the live run itself (edge in this process).

Emulation: the channel emulator and one device process per scenario device are started here (ipc://
sockets in a private temp dir); the edge server runs in this process. LAN: only the edge (and, if the
profile asks for a channel emulator, the emulator) start here; devices connect from other hosts.
Every process started is stopped by its own id at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.profile import Profile

log = logging.getLogger("multispin.launcher")

REPO_ROOT = Path(__file__).resolve().parents[1]


class Launcher:
    """Owns child processes; `stop_all` terminates each by pid (then kills what does not exit)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs = []
        self.device_connect: str | None = None  # where devices connect in this run

    def start(self, label: str, argv: list[str]) -> subprocess.Popen:
        fh = open(self.log_dir / f"{label}.log", "ab")
        self._logs.append(fh)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
        self.procs[label] = proc
        log.debug("started %s (pid %d): %s", label, proc.pid, " ".join(argv))
        return proc

    def start_channel(self, frontend: str, edge: str, control: str, mode: str, spin_s: float) -> subprocess.Popen:
        return self.start("channel", [sys.executable, "-m", "channel_emulator.proxy", "--frontend", frontend,
                                      "--edge", edge, "--control", control, "--mode", mode, "--spin-s", str(spin_s)])

    def start_device(self, label: str, connect: str, draft_onnx: str, hardware: str | None,
                     name: str | None = None) -> subprocess.Popen:
        """A device process; `label` names its log (and process), `name` its device name (default: label)."""
        argv = [sys.executable, "-m", "device_node.node", "--connect", connect, "--name", name or label,
                "--draft", str(draft_onnx)]
        if hardware:
            argv += ["--hardware", hardware]
        return self.start(f"device-{label}", argv)

    def kill(self, label: str) -> None:
        proc = self.procs.get(label)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def failed(self) -> dict[str, int]:
        return {k: p.returncode for k, p in self.procs.items() if p.poll() is not None and p.returncode != 0}

    def stop_all(self, grace_s: float = 10.0) -> dict[str, int | None]:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():  # devices exit on 'bye'; give them a moment first
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(3)
        for fh in self._logs:
            fh.close()
        return {k: p.returncode for k, p in self.procs.items()}


# --- model pair --------------------------------------------------------------------------------------

def resolve_pair(profile: Profile, progress: bool = True) -> dict:
    """Paths of the target, the draft ONNX and the tokenizer (builds the default pair on first need)."""
    m = profile.model
    if m.pair == "local":
        paths = {k: str(Path(v).expanduser()) for k, v in
                 (("target", m.target), ("draft_onnx", m.draft_onnx), ("tokenizer", m.tokenizer))}
        for k, v in paths.items():
            if not Path(v).exists():
                from testbed.cli import CliError

                raise CliError(f"model.{k}: {v!r} does not exist")
        return paths
    from edge_node.model_pair import ensure_default_pair

    pp = ensure_default_pair(progress=progress)
    return {"target": str(pp.target_dir), "draft_onnx": str(pp.draft_onnx), "tokenizer": str(pp.tokenizer),
            "manifest": str(pp.manifest)}


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


# --- the live run --------------------------------------------------------------------------------------

def run_live(profile: Profile, run_dir: Path, *, progress: bool = True, start_devices: bool | None = None,
             bind: str | None = None, on_round=None, pair: dict | None = None) -> dict:
    """Run a whole live session and write the run directory; returns the summary dict."""
    from channel_emulator.state import ChannelState
    from device_node.hardware import load_hardware
    from edge_node.server import EdgeServer
    from edge_node.verifier import BatchedVerifier, load_target
    from testbed import report
    from testbed.controller import Controller
    from testbed.core.sampling import SamplingParams
    from testbed.records import RunRecorder

    run_dir = Path(run_dir)
    recorder = RunRecorder(run_dir)
    pair = pair or resolve_pair(profile, progress=progress)
    tokenizer = load_tokenizer(pair["tokenizer"])
    model = load_target(pair["target"], device=profile.model.device)
    verifier = BatchedVerifier(model, device=profile.model.device, threads=profile.model.threads)
    vocab = verifier.vocab_size
    scenario = profile.scenario_obj(vocab)
    if profile.on_air_vocab_size and profile.on_air_vocab_size < vocab:
        from testbed.cli import CliError

        raise CliError(f"on_air_vocab_size: {profile.on_air_vocab_size} is smaller than the model's vocabulary {vocab}")
    names = [d.name for d in scenario.devices]
    hardware = {n: load_hardware(profile.hardware.get(n)) for n in names}
    channel_state = None
    if profile.channel.state is not None:
        channel_state = ChannelState.from_config(
            {**profile.channel.state, "seed": profile.channel.state.get("seed", profile.seed)},
            [d for d in profile.scenario["devices"]])
    controller = Controller(scenario, policy=profile.policy, fixed_length=profile.fixed_length, seed=profile.seed,
                            channel_state=channel_state,
                            compute_scale={n: h.compute_scale for n, h in hardware.items()},
                            alpha_prior_trials=profile.estimator.alpha_prior_trials,
                            draft_time_window=profile.estimator.draft_time_window,
                            fit_verify_after=profile.estimator.fit_verify_after,
                            pin_mode=profile.pin.mode, pin_draft_len=profile.pin.draft_len,
                            fit_round_overhead=profile.estimator.fit_round_overhead)
    texts = profile.prompt_list()
    prompts = []
    for t in texts:
        ids = tokenizer.encode(t).ids
        if not ids:
            from testbed.cli import CliError

            raise CliError(f"prompt {t!r} encodes to no tokens")
        prompts.append(ids)

    start_devices = profile.start_devices and profile.deployment == "emulation" if start_devices is None \
        else start_devices
    ep = profile.endpoints
    tmp = tempfile.mkdtemp(prefix="ms-")  # short paths: ipc:// names are limited to ~100 bytes
    edge_bind = bind or ep.edge_bind or f"ipc://{tmp}/edge"
    mode = profile.channel.mode
    launcher = Launcher(run_dir / "logs")
    channel = None
    server = None
    recorder.write_meta(profile.snapshot(), channel_mode=mode, model=pair, vocab_size=vocab,
                        hardware={n: h.to_dict() for n, h in hardware.items()}, run_dir=str(run_dir),
                        status="running")
    try:
        server = EdgeServer(edge_bind, verifier, scenario=scenario, controller=controller, prompts=prompts,
                            sampling=SamplingParams(**profile.sampling.model_dump()), seed=profile.seed,
                            deadline_s=profile.deadline_s, max_misses=profile.max_misses,
                            max_new_tokens=profile.max_new_tokens, on_air_vocab_size=profile.on_air_vocab_size,
                            vocab_size=vocab, channel_mode=mode, base_latency_s=profile.channel.base_latency_s,
                            recorder=recorder, policy=profile.policy, prompt_texts=texts)
        device_connect = server.endpoint
        if mode != "passthrough":
            from channel_emulator.proxy import ChannelControl

            front = ep.channel_frontend or f"ipc://{tmp}/front"
            control = ep.channel_control or f"ipc://{tmp}/control"
            edge_for_channel = server.endpoint.replace("0.0.0.0", "127.0.0.1")
            launcher.start_channel(front, edge_for_channel, control, mode, profile.channel.spin_s)
            channel = ChannelControl(control, timeout_s=10.0)
            channel.stats()  # waits until the emulator answers
            device_connect = front.replace("0.0.0.0", "127.0.0.1") if start_devices else (ep.device_connect or front)
        launcher.device_connect = device_connect
        if start_devices:
            for n in names:
                launcher.start_device(n, device_connect, pair["draft_onnx"], profile.hardware.get(n))
        server.channel = channel
        missing = server.wait_for_devices(names, profile.wait_for_devices_s)
        if missing:
            failed = launcher.failed()
            detail = f"; exited: {failed} (logs in {run_dir / 'logs'})" if failed else ""
            if len(missing) == len(names):
                from testbed.cli import CliError

                raise CliError(f"no device registered within {profile.wait_for_devices_s} s{detail}")
            log.warning("devices %s did not register; running without them%s", missing, detail)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=profile.rounds, unit="round", desc=f"{profile.name} [{profile.policy}]")
        tokens = [0]

        def _on_round(rec):
            tokens[0] += rec["measured"]["tokens"]
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tok=tokens[0], ul=rec["num_ul"], meas=f"{rec['measured']['goodput_tps'] or 0:.1f}",
                                pred=f"{rec['predicted']['goodput_tps'] or 0:.1f}", refresh=False)
            if on_round is not None:
                on_round(rec, server, launcher)

        records = server.run(profile.rounds, on_round=_on_round)
        if bar is not None:
            bar.close()
        sessions = server.finish()
        outputs = {}
        for n, s in sessions.items():
            outputs[n] = {"session": s.sid, "prompt": texts[sorted(server.known).index(n) % len(texts)],
                          "prompt_tokens": len(s.prompt_ids), "output_tokens": len(s.output_ids),
                          "output_ids": s.output_ids, "text": tokenizer.decode(s.output_ids),
                          "rounds": s.rounds, "accepted": s.accepted, "drafted": s.drafted,
                          "acceptance": s.accepted / s.drafted if s.drafted else None,
                          "hardware": s.hardware}
        recorder.write_outputs(outputs)
        summary = report.summarize(records)
        summary["refused_messages"] = server.refused
        if channel is not None:
            try:
                summary["channel_stats"] = channel.stats()
                channel.stop()
            except (TimeoutError, RuntimeError) as exc:
                log.warning("channel emulator: %s", exc)
        recorder.write_summary(summary)
        recorder.update_meta(status="complete")
        return summary
    except BaseException:
        recorder.update_meta(status="failed")
        raise
    finally:
        if server is not None:
            server.close()
        if channel is not None:
            channel.close()
        codes = launcher.stop_all(grace_s=5.0)
        recorder.update_meta(processes=codes)
        recorder.close()
        for f in Path(tmp).glob("*"):
            try:
                f.unlink()
            except OSError:
                pass
        try:
            os.rmdir(tmp)
        except OSError:
            pass
