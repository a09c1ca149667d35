"""The run directory: metadata, one JSON line per round (written and fsynced as the round ends), outputs and a
summary.

Layout of ``runs/<stamp>/``:
  meta.json       profile snapshot, command line, overrides, seed, tags and note, version, git revision, package
                  versions, host facts, channel mode, start time, pid; status (running -> complete |
                  incomplete | interrupted | failed) and reason
  profile.yaml    the resolved profile (the snapshot in meta.json as YAML)
  rounds.jsonl    one round record per line, written as each round ends (a write that fails leaves no partial
                  line)
  progress.jsonl  per device session: the token ids generated so far, one line per round with what changed
                  since the line before (`load_progress` folds them; what `multispin run --resume` continues
                  from; runs of earlier releases have a progress.json snapshot instead)
  outputs.json    per device session: prompt, generated text, token counts (written when the run ends)
  summary.json    run totals, status and reason (written for every run, however it ends)

Durability: each line is in the file (the kernel's page cache) when the call returns, so a crash of the
process, kill -9 included, keeps every line written. fsync, which only a power cut or a kernel crash needs,
costs about as much as the rest of a round's bookkeeping together, so by default a thread of the
recorder makes it as soon as a line is written, off the round's path (`_Syncer`); a failed fsync is raised by
the next write. With `sync_interval_s` the logs are instead fsynced inline, together, at most that often (0:
after every line). Either way they are fsynced when the recorder closes and by `sync()`, and a partial line
is never left for a reader to keep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from testbed.runtime.errors import TestbedError

log = logging.getLogger("multispin.records")

PACKAGES = ("multispin-testbed", "numpy", "torch", "transformers", "tokenizers", "onnxruntime", "pyzmq", "pydantic",
            "scipy")


def new_run_dir(base: str | Path = "runs", label: str | None = None) -> Path:
    """A fresh ``<base>/<UTC stamp>[-label][-n]/``; a TestbedError names the folder when it cannot be made."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if label:  # a plug-in policy's `module:Class` makes an awkward folder name (a colon, perhaps a slash)
        label = re.sub(r"[^A-Za-z0-9._-]", "-", label)
    name = stamp if not label else f"{stamp}-{label}"
    path = Path(base) / name
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{name}-{n}"
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise unwritable(Path(base), exc) from None
    return path


def unwritable(path: Path, exc: OSError) -> TestbedError:
    """The error of a run directory that cannot be written (full disk, permissions, not a folder)."""
    return TestbedError(f"runs directory full or unwritable: {path}: {exc.strerror or exc}")


def git_revision() -> str | None:
    """The checkout's commit (+dirty) when the code runs from a git checkout; None for an installed package
    (its version is in package_versions), even when site-packages lies inside some other repository."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # a folder, or a file in a git worktree
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        rev = out.stdout.strip() if out.returncode == 0 else None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=5)
        if rev and dirty.returncode == 0 and dirty.stdout.strip():
            rev += "+dirty"
        return rev
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


PROFILE_FILE = "profile.yaml"


def write_profile_yaml(path: Path, profile_snapshot: dict) -> None:
    """The resolved profile as YAML (the snapshot meta.json holds, in the form a profile file has)."""
    import yaml

    text = ("# The resolved profile of this run (file, --set, flags, defaults); meta.json holds the same as "
            "`profile`.\n# multispin rerun RUN_DIR repeats the run; multispin run profile.yaml runs it again too.\n"
            + yaml.safe_dump(_nan_to_none(profile_snapshot), sort_keys=False, default_flow_style=None, width=110))
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_facts() -> dict:
    """What reproduces a run besides its profile: the command line as typed (`argv`, and `command`, one
    shell-quoted line), the project's version and git commit, the package versions, and the host (its name
    in `host`; CPU model, cores, memory, OS, Python in `host_info`)."""
    import shlex

    from testbed import __version__

    argv = [str(a) for a in sys.argv]
    prog = "multispin" if argv and (Path(argv[0]).name in ("multispin", "__main__.py") or argv[0] == "-c") else None
    shown = [prog, *argv[1:]] if prog else argv
    return {"version": __version__, "git_revision": git_revision(), "packages": package_versions(),
            "host": platform.node(), "host_info": host_facts(), "argv": argv,
            "command": " ".join(shlex.quote(a) for a in shown), "cwd": os.getcwd()}


def host_facts() -> dict:
    """The machine a run ran on: CPU model, logical cores (and those this process may use), memory, OS,
    Python; a fact that cannot be read is null."""
    cpu = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                cpu = line.split(":", 1)[1].strip()
                break
    cpu = cpu or platform.processor() or None
    memory = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    if memory is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"cpu_model": cpu, "cores": os.cpu_count(), "cores_usable": usable, "memory_bytes": memory,
            "os": platform.platform(), "machine": platform.machine(),
            "python": f"{platform.python_implementation()} {platform.python_version()}"}


def _json_default(obj: Any):
    # numpy scalars and arrays sneak into records; store them as plain numbers/lists.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default, allow_nan=False, separators=(",", ":"))


class _JsonLines:
    """An append-only JSON-lines file, unbuffered: what `append` wrote is in the file, whole or not at all (a
    write that fails is cut back to the last complete line). Opening it cuts a torn last line."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = open(path, "a+b", buffering=0)  # readable too: the tail check
        self.size = self._repair_tail()
        self.dirty = False  # written since the last fsync

    def _repair_tail(self) -> int:
        """Cut a torn last line (a run killed mid-write, or before these writes were atomic); returns the size."""
        fd = self.fh.fileno()
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return size
        tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        log.warning("%s: cutting a torn last line (%d bytes)", self.path, size - keep)
        os.ftruncate(fd, keep)
        return keep

    def append(self, data: bytes) -> None:
        """Write one line (`data` ends with a newline); OSError after cutting a partial write back."""
        fd = self.fh.fileno()
        whole = False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            whole = True
        except BaseException:  # ENOSPC, EIO, or a signal mid-write: leave no partial line behind
            # The file says how much was written: a signal handler may raise after the last write returned
            # (the line whole, and maybe read already), which must not cut it back.
            with contextlib.suppress(OSError):
                whole = os.fstat(fd).st_size == self.size + len(data)
                if not whole:
                    os.ftruncate(fd, self.size)
            raise
        finally:
            if whole:  # readers may have seen the line: nothing after this may cut it back
                self.size += len(data)
                self.dirty = True

    def sync(self) -> None:
        if self.dirty and not self.fh.closed:
            self.dirty = False  # before the fsync: a line appended meanwhile marks it again
            try:
                os.fsync(self.fh.fileno())
            except BaseException:  # not durable yet: the next sync tries again
                self.dirty = True
                raise

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()


class _Syncer(threading.Thread):
    """fsyncs the logs each time `wake` is called, in a thread of its own (fsync releases the GIL, so the round
    goes on meanwhile); the first error is kept in `error` for the writer to raise."""

    def __init__(self, logs):
        super().__init__(name="multispin-records-fsync", daemon=True)
        self.logs = logs  # a callable: the logs open now
        self.error: OSError | None = None
        self._wake, self._stopping = threading.Event(), False

    def wake(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                for lines in self.logs():
                    lines.sync()
            except OSError as exc:
                self.error = self.error or exc
            except ValueError:  # a log closed meanwhile (the recorder closes after stopping this thread)
                pass
            if self._stopping:
                return

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.join(10)


class RunRecorder:
    """Writes one run directory. Every write is complete or absent: a round is one line (a write that fails is
    cut back to the last complete line and raises a TestbedError), so is each progress entry; the JSON files
    are replaced atomically. Opening an existing directory (a resumed run) cuts torn last lines. The logs are
    fsynced as each line is written, by a thread of the recorder (`sync_interval_s` None), or inline at most
    every `sync_interval_s` (0: after every line); and on `sync()` and on `close()` (see the module's
    docstring)."""

    def __init__(self, run_dir: str | Path, *, sync_interval_s: float | None = None):
        self.dir = Path(run_dir)
        self.sync_interval_s = None if sync_interval_s is None else float(sync_interval_s)
        self._last_sync = -math.inf
        self._syncer: _Syncer | None = None
        self._progress_log: _JsonLines | None = None  # opened by the first write_progress
        self._progress_sent: dict[str, dict] = {}  # device -> its entry as the progress log has it
        self._requests_log: _JsonLines | None = None  # requests.jsonl, opened by the first append_request
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._rounds_log = _JsonLines(self.dir / "rounds.jsonl")
        except OSError as exc:
            raise unwritable(self.dir, exc) from None
        self.count = 0
        self.last_round = self._last_round_on_disk()
        self.write_s = 0.0  # time spent in append_round and write_progress, fsyncs included (where a round goes)

    def _last_round_on_disk(self) -> int | None:
        last = None
        for rec in iter_rounds(self.dir):
            if isinstance(rec.get("round"), int):
                last = rec["round"]
        return last

    def write_meta(self, profile_snapshot: dict, **extra: Any) -> None:
        """meta.json of a new run (see `run_facts`; `extra` adds or replaces fields: status, pid, overrides,
        tags, note, rerun_of, ...) and profile.yaml, the resolved profile that `multispin run profile.yaml`
        runs again."""
        meta = {"created_utc": _now(), **run_facts(), "profile": profile_snapshot, **extra}
        self._write(self.dir / "meta.json", meta)
        try:
            write_profile_yaml(self.dir / PROFILE_FILE, profile_snapshot)
        except OSError as exc:
            raise unwritable(self.dir, exc) from None

    def read_meta(self) -> dict:
        path = self.dir / "meta.json"
        try:
            return json.loads(path.read_text()) if path.exists() else {}
        except (OSError, json.JSONDecodeError):
            return {}

    def update_meta(self, **fields: Any) -> None:
        meta = self.read_meta()
        meta.update(fields)
        self._write(self.dir / "meta.json", meta)

    def append_round(self, record: dict) -> None:
        """Append one round record as one complete line (fsynced with the others, see the class)."""
        r = record.get("round")
        if r is not None and r == self.last_round:
            log.debug("round %s is recorded already", r)  # a write repeated after an interrupted one
            return
        t = time.perf_counter()
        size = self._rounds_log.size
        try:
            self._rounds_log.append((_line(record) + "\n").encode())
        except OSError as exc:
            raise unwritable(self.dir, exc) from None
        finally:
            if self._rounds_log.size != size:  # the line is in, even where a signal came right after it
                self.count += 1
                self.last_round = r
        self._sync_due()
        self.write_s += time.perf_counter() - t

    def append_request(self, record: dict) -> None:
        """requests.jsonl: one served request's record (`edge_node.requests`) as one complete line."""
        try:
            if self._requests_log is None:
                self._requests_log = _JsonLines(self.dir / REQUESTS_LOG)
            self._requests_log.append((_line(record) + "\n").encode())
        except OSError as exc:
            raise unwritable(self.dir, exc) from None
        self._sync_due()

    def write_outputs(self, outputs: dict) -> None:
        self._write(self.dir / "outputs.json", outputs)

    def write_summary(self, summary: dict) -> None:
        self._write(self.dir / "summary.json", summary)

    def write_progress(self, progress: dict) -> None:
        """progress.jsonl: one line per call, {"round", "devices": {name: entry}} where each entry holds only
        what changed since this recorder's previous line: its changed fields, and of `output_ids` the ids
        from index `output_ids_from` on (the rest are kept). A recorder's first line is whole. `progress` is
        the full state ({"round": r, "devices": {name: {"output_ids": [...], ...}}}); `load_progress` gives
        it back."""
        t = time.perf_counter()
        devices = {}
        for name, entry in (progress.get("devices") or {}).items():
            delta = _progress_delta(self._progress_sent.get(name), entry)
            if delta:
                devices[name] = delta
                self._progress_sent[name] = {**entry, "output_ids": list(entry.get("output_ids") or [])}
        line = {k: v for k, v in progress.items() if k != "devices"}
        line["devices"] = devices
        try:
            if self._progress_log is None:
                self._progress_log = _JsonLines(self.dir / PROGRESS_LOG)
            self._progress_log.append((_line(line) + "\n").encode())
        except OSError as exc:
            raise unwritable(self.dir, exc) from None
        self._sync_due()
        self.write_s += time.perf_counter() - t

    def _logs(self) -> list[_JsonLines]:
        return [lines for lines in (self._rounds_log, self._progress_log, self._requests_log) if lines is not None]

    def _sync_due(self) -> None:
        if self.sync_interval_s is None:
            self._raise_sync_error()
            if self._syncer is None:
                self._syncer = _Syncer(self._logs)
                self._syncer.start()
            self._syncer.wake()
        elif time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()

    def _raise_sync_error(self) -> None:
        if self._syncer is not None and self._syncer.error is not None:
            exc, self._syncer.error = self._syncer.error, None
            raise unwritable(self.dir, exc)

    def sync(self) -> None:
        """fsync what the logs hold (rounds, then progress); a TestbedError when the disk refuses."""
        self._last_sync = time.monotonic()
        self._raise_sync_error()
        try:
            for lines in self._logs():
                lines.sync()
        except OSError as exc:
            raise unwritable(self.dir, exc) from None

    def end_run(self, status: str, reason: str, summary: dict | None = None, **meta: Any) -> None:
        """Best effort, for a run that stopped: summary.json and meta.json say how. Never raises (the error
        that stopped the run is the one to report); a failed write is logged."""
        summary = {"rounds": 0, **(summary or {}), "status": status, "reason": reason}
        for write in (lambda: self.write_summary(summary),  # each fsyncs the logs first (`_write`)
                      lambda: self.update_meta(status=status, reason=reason, ended_utc=_now(), **meta)):
            try:
                write()
            except TestbedError as exc:  # the same error as the one that stopped the run: said once, by it
                log.log(logging.INFO if str(exc) in reason else logging.ERROR, "%s", exc)

    def _write(self, path: Path, obj: Any) -> None:
        self.sync()  # meta.json, outputs.json, summary.json never claim more than the logs durably hold
        try:
            _write_json(path, obj)
        except OSError as exc:
            raise unwritable(self.dir, exc) from None

    def close(self) -> None:
        """fsync and close the logs (a failed fsync is logged: the lines are written, only not yet durable)."""
        if self._syncer is not None:
            self._syncer.stop()
        try:
            self.sync()
        except TestbedError as exc:
            log.error("%s", exc)
        for lines in (self._rounds_log, self._progress_log, self._requests_log):
            if lines is not None:
                lines.close()


PROGRESS_LOG = "progress.jsonl"
REQUESTS_LOG = "requests.jsonl"  # one line per served request (runs with `requests:`)
LEGACY_PROGRESS = "progress.json"  # earlier releases: a snapshot rewritten after every round


def _line(obj: Any) -> str:
    """One JSON line; NaN is not JSON, so a missing measurement (NaN) is null."""
    try:
        return dumps(obj)
    except ValueError:  # a NaN somewhere (round records have none: the controller made them finite)
        return dumps(_nan_to_none(obj))


def _progress_delta(sent: dict | None, entry: dict) -> dict:
    """What `entry` changes in a device's progress entry `sent` (None: the whole entry); {} if nothing."""
    if sent is None:
        return dict(entry)
    delta = {k: v for k, v in entry.items() if k != "output_ids" and (k not in sent or sent[k] != v)}
    ids, old = list(entry.get("output_ids") or []), sent["output_ids"]
    keep = len(old)
    if ids[:keep] != old:  # tokens taken back (a session ended before confirming them): the common prefix
        keep = next((i for i, (a, b) in enumerate(zip(ids, old)) if a != b), min(len(ids), len(old)))
    if keep < len(old) or len(ids) > keep:
        delta["output_ids_from"], delta["output_ids"] = keep, ids[keep:]
    return delta


def load_progress(run_dir: str | Path) -> dict | None:
    """Every device's progress ({"round": r, "devices": {name: {"output_ids": [...], "rounds", ...}}}) as the
    run wrote it last: progress.jsonl folded line by line, or a run of an earlier release's progress.json;
    None if there is neither (a torn last line is skipped; a line that does not fit the ones before ends the
    fold there, with a warning)."""
    run_dir = Path(run_dir)
    path = run_dir / PROGRESS_LOG
    if not path.is_file():
        try:
            data = json.loads((run_dir / LEGACY_PROGRESS).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None
    state: dict = {"round": None, "devices": {}}
    for n, line in enumerate(_json_lines(path)):
        devices = line.get("devices") if isinstance(line, dict) else None
        if not isinstance(devices, dict) or not _fold_progress(state["devices"], devices):
            log.warning("%s: line %d does not follow the lines before it; using the progress up to there", path,
                        n + 1)
            break
        state.update({k: v for k, v in line.items() if k != "devices"})
    return state


def _fold_progress(state: dict[str, dict], devices: dict) -> bool:
    """Apply one progress line's entries to `state`; False (state unchanged) when one does not fit."""
    updates = {}
    for name, delta in devices.items():
        if not isinstance(delta, dict):
            return False
        entry = {**state.get(name, {}), **delta}
        start = entry.pop("output_ids_from", 0)
        if "output_ids" in delta:
            old = state.get(name, {}).get("output_ids", [])
            if not (isinstance(start, int) and 0 <= start <= len(old) and isinstance(delta["output_ids"], list)):
                return False
            entry["output_ids"] = old[:start] + delta["output_ids"]
        updates[name] = entry
    state.update(updates)
    return True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def json_text(obj: Any, *, indent: int | None = None) -> str:
    """Strict JSON for files and --json output: a non-finite number is null (never NaN or Infinity, which
    strict parsers refuse), numpy values as plain numbers."""
    return json.dumps(_nan_to_none(obj), default=_json_default, indent=indent, allow_nan=False)


def _nan_to_none(obj: Any):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def _write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write a temporary file (fsynced), rename it over `path`: readers see the old file or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    data = json_text(obj, indent=2 if fsync else None).encode()
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def iter_rounds(run_dir: str | Path) -> Iterator[dict]:
    """Round records; a torn last line (the run was killed mid-write) is skipped."""
    path = Path(run_dir) / "rounds.jsonl"
    if not Path(run_dir).exists():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no round records (is {run_dir} a run directory?)")
    yield from _json_lines(path)


def _json_lines(path: Path) -> Iterator[Any]:
    """The JSON values of a JSON-lines file; lines that do not parse (a torn last line) are skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def load_requests(run_dir: str | Path) -> list[dict]:
    """The request records of a run that served requests (requests.jsonl), [] for one that did not."""
    path = Path(run_dir) / REQUESTS_LOG
    return [r for r in _json_lines(path) if isinstance(r, dict)] if path.is_file() else []


def read_meta(run_dir: str | Path, what: str) -> dict:
    """A run directory's meta.json as a dict; a TestbedError, prefixed with `what`, says why it cannot be read."""
    try:
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
    except FileNotFoundError:
        raise TestbedError(f"{what}: no meta.json there (not a run directory)") from None
    except (OSError, ValueError) as exc:
        raise TestbedError(f"{what}: meta.json unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise TestbedError(f"{what}: meta.json holds no run metadata")
    return meta


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return meta, list(iter_rounds(run_dir))


def monotonic() -> float:
    return time.monotonic()
