"""The run directory: metadata, one JSON line per round (flushed and fsynced), outputs and a summary.

Layout of ``runs/<stamp>/``:
  meta.json       profile snapshot, git revision, package versions, host, channel mode, start time, pid;
                  status (running -> complete | incomplete | interrupted | failed) and reason
  rounds.jsonl    one round record per line, written as each round ends (a crash keeps every earlier round;
                  a write that fails leaves no partial line)
  progress.json   per device session: the token ids generated so far (rewritten after every round; what
                  `multispin run --resume` continues from)
  outputs.json    per device session: prompt, generated text, token counts (written when the run ends)
  summary.json    run totals, status and reason (written for every run, however it ends)
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from testbed.errors import TestbedError

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
    root = Path(__file__).resolve().parents[1]
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


def _json_default(obj: Any):
    # numpy scalars and arrays sneak into records; store them as plain numbers/lists.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default, allow_nan=False, separators=(",", ":"))


class RunRecorder:
    """Writes one run directory. Every write is complete or absent: a round is one line, written, flushed and
    fsynced (a write that fails is cut back to the last complete line and raises a TestbedError); the JSON
    files are replaced atomically. Opening an existing directory (a resumed run) cuts a torn last line."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        path = self.dir / "rounds.jsonl"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # Unbuffered: what append_round wrote is what is in the file, so a failure can be cut back exactly.
            self._rounds = open(path, "a+b", buffering=0)  # readable too: the tail check below
            self._size = self._repair_tail()
        except OSError as exc:
            raise unwritable(self.dir, exc) from None
        self.count = 0
        self.last_round = self._last_round_on_disk()

    def _repair_tail(self) -> int:
        """Cut a torn last line (a run killed mid-write, or before these writes were atomic); returns the size."""
        fd = self._rounds.fileno()
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return size
        tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        log.warning("%s: cutting a torn last line (%d bytes)", self.dir / "rounds.jsonl", size - keep)
        os.ftruncate(fd, keep)
        return keep

    def _last_round_on_disk(self) -> int | None:
        last = None
        for rec in iter_rounds(self.dir):
            if isinstance(rec.get("round"), int):
                last = rec["round"]
        return last

    def write_meta(self, profile_snapshot: dict, **extra: Any) -> None:
        meta = {"created_utc": _now(), "git_revision": git_revision(), "packages": package_versions(),
                "host": platform.node(), "argv": sys.argv, "profile": profile_snapshot, **extra}
        self._write(self.dir / "meta.json", meta)

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
        """Append one round record as one complete line, flushed and fsynced."""
        r = record.get("round")
        if r is not None and r == self.last_round:
            log.debug("round %s is recorded already", r)  # a write repeated after an interrupted one
            return
        # NaN is not JSON: a missing measurement is null.
        data = (dumps(_nan_to_none(record)) + "\n").encode()
        fd = self._rounds.fileno()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException as exc:  # ENOSPC, EIO, or a signal mid-write: leave no partial line behind
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise unwritable(self.dir, exc) from None
            raise
        # The line is whole and readers may have seen it: a signal during fsync must not cut it back.
        self._size += len(data)
        self.count += 1
        self.last_round = r
        try:
            os.fsync(fd)
        except OSError as exc:
            raise unwritable(self.dir, exc) from None

    def write_outputs(self, outputs: dict) -> None:
        self._write(self.dir / "outputs.json", outputs)

    def write_summary(self, summary: dict) -> None:
        self._write(self.dir / "summary.json", summary)

    def write_progress(self, progress: dict) -> None:
        """progress.json: atomic but not fsynced (rewritten every round; a killed process loses nothing
        the kernel already has, and only a power cut could cost the last few rounds of it)."""
        self._write(self.dir / "progress.json", progress, fsync=False)

    def end_run(self, status: str, reason: str, summary: dict | None = None, **meta: Any) -> None:
        """Best effort, for a run that stopped: summary.json and meta.json say how. Never raises (the error
        that stopped the run is the one to report); a failed write is logged."""
        summary = {"rounds": 0, **(summary or {}), "status": status, "reason": reason}
        for write in (lambda: self.write_summary(summary),
                      lambda: self.update_meta(status=status, reason=reason, ended_utc=_now(), **meta)):
            try:
                write()
            except TestbedError as exc:
                log.error("%s", exc)

    def _write(self, path: Path, obj: Any, fsync: bool = True) -> None:
        try:
            _write_json(path, obj, fsync=fsync)
        except OSError as exc:
            raise unwritable(self.dir, exc) from None

    def close(self) -> None:
        if not self._rounds.closed:
            self._rounds.close()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _nan_to_none(obj: Any):
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def _write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write a temporary file (fsynced), rename it over `path`: readers see the old file or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    data = json.dumps(_nan_to_none(obj), default=_json_default, indent=2 if fsync else None,
                      allow_nan=False).encode()
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
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no round records (is {run_dir} a run directory?)")
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return meta, list(iter_rounds(run_dir))


def monotonic() -> float:
    return time.monotonic()
