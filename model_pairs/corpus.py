"""Training text for the default model pair, from sources reachable without a model hub.

`python-doc`: the reStructuredText sources of the Python documentation in Debian's `python3.11-doc`,
fetched with `apt-get download` and unpacked with `dpkg-deb -x` (never installed).
`stdlib`: the standard-library sources of the running interpreter (always present; the fallback).
Files are read in sorted order and split by a hash of their path, so the corpus is deterministic.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("auto", "python-doc", "stdlib")
DEB_PACKAGE = "python3.11-doc"


@dataclass
class Corpus:
    source: str  # which source was used in the end
    train: list[str]
    heldout: list[str]

    @property
    def chars(self) -> tuple[int, int]:
        return sum(map(len, self.train)), sum(map(len, self.heldout))


def _is_heldout(rel_path: str, heldout_every: int) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "little")
    return h % heldout_every == 0


def _fetch_python_doc(work_dir: Path) -> Path:
    """Download and unpack the Debian docs package into work_dir; returns the directory of .rst sources."""
    root = work_dir / "python-doc"
    done = root / ".unpacked"
    if not done.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise RuntimeError("apt-get/dpkg-deb not available")
        dl = work_dir / "deb"
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=dl, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        debs = sorted(dl.glob(f"{DEB_PACKAGE}_*.deb"))
        if not debs:
            raise RuntimeError(f"apt-get download {DEB_PACKAGE} produced no .deb")
        if root.exists():
            shutil.rmtree(root)
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], check=True, timeout=600)
        done.write_text(debs[-1].name)
    candidates = sorted(p for p in root.rglob("_sources") if p.is_dir())
    if not candidates:
        raise RuntimeError(f"no _sources directory in {DEB_PACKAGE}")
    return candidates[0]


def _read_files(files: list[Path], base: Path, heldout_every: int, max_chars: int | None) -> Corpus:
    train, heldout = [], []
    total = 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if max_chars is not None and total + len(text) > max_chars:
            text = text[: max(0, max_chars - total)]
        rel = f.relative_to(base).as_posix()
        (heldout if _is_heldout(rel, heldout_every) else train).append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return Corpus("", train, heldout)


def load_corpus(source: str, work_dir: Path, *, heldout_every: int = 20,
                max_chars: int | None = None) -> Corpus:
    """Load the corpus; `auto` tries the Python docs and falls back to the stdlib sources."""
    if source not in SOURCES:
        raise ValueError(f"corpus source {source!r}: allowed {SOURCES}")
    if source in ("auto", "python-doc"):
        try:
            base = _fetch_python_doc(work_dir)
            files = sorted(p for p in base.rglob("*") if p.is_file() and p.name.endswith((".rst.txt", ".txt")))
            corpus = _read_files(files, base, heldout_every, max_chars)
            if corpus.train and corpus.heldout:
                corpus.source = "python-doc"
                return corpus
            raise RuntimeError("python-doc corpus is empty")
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            if source == "python-doc":
                raise
            log.warning("python-doc corpus unavailable (%s); using the stdlib sources", exc)
    base = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    corpus = _read_files(files, base, heldout_every, max_chars)
    if not corpus.train or not corpus.heldout:
        raise RuntimeError(f"stdlib corpus at {base} gave {len(corpus.train)} train / "
                           f"{len(corpus.heldout)} held-out files: too small")
    corpus.source = "stdlib"
    return corpus
