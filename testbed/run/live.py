"""One whole live run: the run directory opened, the pair resolved, the session built and driven to its end."""

from __future__ import annotations

import os
from pathlib import Path

from testbed.run.launcher import interrupt_signals, require_edge_extra, resolve_pair, status_of
from testbed.run.profile import Profile


def run_meta(*, argv: list[str] | None = None, overrides: list[str] | None = None, tags: list[str] | None = None,
             note: str | None = None, **more) -> dict:
    """The fields a command adds to a new run's meta.json: `argv` (the multispin command line as given; also
    `command`, one shell-quoted line), `overrides` (the flags that changed the profile, in order: --set KEY=VALUE,
    --rounds N, ...), `tags` and `note` (--tag, --note), and `more` (rerun_of, sweep, compare, ...)."""
    import shlex

    out: dict = {"overrides": list(overrides or []), "tags": list(tags or []), "note": note}
    if argv is not None:
        out["argv"] = ["multispin", *argv]
        out["command"] = " ".join(shlex.quote(str(a)) for a in out["argv"])
    return {**out, **more}


def run_live(profile: Profile, run_dir: Path, *, progress: bool = True, start_devices: bool | None = None,
             bind: str | None = None, on_round=None, pair: dict | None = None, resume=None,
             meta: dict | None = None, pool=None, say=None) -> dict:
    """Run a whole live session and write the run directory; returns the summary dict.

    `start_devices`: start one device process per scenario device (default: the profile's choice, emulation
    only); `bind`: the edge endpoint (default: the profile's, else a private ipc:// socket);
    `on_round(record, server, launcher)`: called after each round; `pair`: paths from `resolve_pair`;
    `resume`: a `testbed.run.session.Resume` (from `load_resume`) to continue an interrupted run in `run_dir`;
    `meta`: more fields for a new run's meta.json (`run_meta`: the command line, overrides, tags, note, ...);
    `pool`: a `testbed.run.warm.WarmPool` whose loaded target and running processes this run reuses where its
    settings allow (warm trials of compare and campaign); `say(text)`: each start phase as it begins (default:
    a line on stderr with `progress`, none without).
    Raises TestbedError for what the user can fix (model files, prompts, no device registered, ports, keys);
    SIGTERM and Ctrl-C raise `RunInterrupted` (a KeyboardInterrupt). Whatever happens, the run directory
    gets meta.json and summary.json with the run's status (complete, incomplete, interrupted or failed).
    """
    require_edge_extra()
    from testbed.runtime.records import RunRecorder

    with interrupt_signals():
        # a clear error now if the runs directory is not writable
        recorder = RunRecorder(run_dir, sync_interval_s=profile.records_sync_interval_s)
        try:
            if resume is None:
                recorder.write_meta(profile.snapshot(), **{"seed": profile.seed, **(meta or {})}, status="running",
                                    pid=os.getpid())
            else:
                recorder.update_meta(status="running", reason=None, pid=os.getpid())
            pair = pair or resolve_pair(profile, progress=progress)
            if say is None and progress:
                say = stderr_line
            if say is not None:
                say("start: the model pair" if pool is not None else "start: loading the model pair")
            from testbed.run.session import build_session, run_session  # loads torch: only once a run can start

            session = build_session(profile, run_dir, pair, start_devices=start_devices, bind=bind, resume=resume,
                                    pool=pool)
            session.say = say
        except BaseException as exc:
            recorder.end_run(*status_of(exc))
            recorder.close()
            raise
        return run_session(session, progress=progress, on_round=on_round, recorder=recorder)


def stderr_line(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)
