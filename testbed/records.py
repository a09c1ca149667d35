"""The run directory: metadata, one JSON line per round (flushed and fsynced), outputs and a summary.

Layout of ``runs/<stamp>/``:
  meta.json       profile snapshot, git revision, package versions, host, channel mode, start time
  rounds.jsonl    one round record per line, written as each round ends (a crash keeps every earlier round)
  outputs.json    per device session: prompt, generated text, token counts (written at the end)
  summary.json    run totals (written at the end)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PACKAGES = ("numpy", "torch", "transformers", "tokenizers", "onnxruntime", "pyzmq", "pydantic", "scipy")


def new_run_dir(base: str | Path = "runs", label: str | None = None) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = stamp if not label else f"{stamp}-{label}"
    path = Path(base) / name
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{name}-{n}"
    path.mkdir(parents=True)
    return path


def git_revision() -> str | None:
    root = Path(__file__).resolve().parents[1]
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
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rounds = open(self.dir / "rounds.jsonl", "a", encoding="utf-8")
        self.count = 0

    def write_meta(self, profile_snapshot: dict, **extra: Any) -> None:
        meta = {"created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "git_revision": git_revision(), "packages": package_versions(), "host": platform.node(),
                "argv": sys.argv, "profile": profile_snapshot, **extra}
        _write_json(self.dir / "meta.json", meta)

    def update_meta(self, **fields: Any) -> None:
        path = self.dir / "meta.json"
        meta = json.loads(path.read_text()) if path.exists() else {}
        meta.update(fields)
        _write_json(path, meta)

    def append_round(self, record: dict) -> None:
        # NaN is not JSON: a missing measurement is null.
        self._rounds.write(dumps(_nan_to_none(record)) + "\n")
        self._rounds.flush()
        os.fsync(self._rounds.fileno())
        self.count += 1

    def write_outputs(self, outputs: dict) -> None:
        _write_json(self.dir / "outputs.json", outputs)

    def write_summary(self, summary: dict) -> None:
        _write_json(self.dir / "summary.json", summary)

    def close(self) -> None:
        if not self._rounds.closed:
            self._rounds.close()


def _nan_to_none(obj: Any):
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_nan_to_none(obj), default=_json_default, indent=2, allow_nan=False))
    os.replace(tmp, path)


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
