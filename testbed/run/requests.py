"""A run's requests (profile `requests:`): the prompt set, the arrival times per device, and the request queues
the edge serves (`edge_node.requests`). docs/serving-metrics.md."""

from __future__ import annotations

import json
from pathlib import Path

from edge_node.requests import Request, RequestQueues
from testbed.core.arrivals import closed_arrivals, device_rng, poisson_arrivals, trace_arrivals
from testbed.runtime.errors import TestbedError

SHIPPED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts.txt"
PROMPT_STREAM = 1  # `device_rng` stream of the prompt draws (0: the arrivals)


class RequestsError(TestbedError, ValueError):
    """A prompt set or trace that cannot be used; the message names the field."""


def load_prompt_set(source: str, field: str = "prompt") -> list[str]:
    """The prompt texts of `requests.prompts`: shipped, a .txt file (one prompt a line, # comments, \\n a
    newline), a .jsonl file (`field` of each line, else its `text`), or hf:NAME[:SPLIT] (a Hugging Face
    dataset in the local cache; needs `datasets`)."""
    if source == "shipped":
        return _text_prompts(SHIPPED_PROMPTS)
    if source.startswith("hf:"):
        return _hf_prompts(source[3:], field)
    path = Path(source).expanduser()
    if not path.is_file():
        raise RequestsError(f"requests.prompts: {source!r} is not a file (give shipped, a .txt or .jsonl file, or "
                            f"hf:DATASET[:SPLIT])")
    prompts = _jsonl_prompts(path, field) if path.suffix == ".jsonl" else _text_prompts(path)
    if not prompts:
        raise RequestsError(f"requests.prompts: {source!r} holds no prompts")
    return prompts


def _text_prompts(path: Path) -> list[str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [ln.replace("\\n", "\n") for ln in lines if ln and not ln.startswith("#")]


def _jsonl_prompts(path: Path, field: str) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestsError(f"requests.prompts: {path}:{i}: not JSON ({exc})") from None
        text = row.get(field, row.get("text")) if isinstance(row, dict) else row if isinstance(row, str) else None
        if not isinstance(text, str) or not text:
            raise RequestsError(f"requests.prompts: {path}:{i}: no text in field {field!r} (nor 'text')")
        out.append(text)
    return out


def _hf_prompts(spec: str, field: str) -> list[str]:
    name, _, split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise RequestsError(f"requests.prompts: hf:{spec} needs the `datasets` package (pip install datasets), "
                            "with the dataset in its local cache; or give a .jsonl file") from None
    try:
        data = datasets.load_dataset(name, split=split or "train", download_mode="reuse_cache_if_exists")
    except Exception as exc:  # datasets raises many types (offline, not found, bad split)
        raise RequestsError(f"requests.prompts: hf:{spec}: cannot load it offline ({type(exc).__name__}: "
                            f"{exc})") from None
    column = field if field in data.column_names else "text" if "text" in data.column_names else None
    if column is None:
        raise RequestsError(f"requests.prompts: hf:{spec} has no column {field!r} (columns: "
                            f"{', '.join(data.column_names)}); set requests.prompt_field")
    return [t for t in data[column] if isinstance(t, str) and t]


def load_trace(path: str, names: list[str]) -> dict[str, list[float]]:
    """Arrival times per device from a trace file: one request a line, `T` (every device gets it) or `T DEVICE`
    (whitespace or a comma between), # comments."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RequestsError(f"requests.trace: {path!r} is not a file")
    out: dict[str, list[float]] = {n: [] for n in names}
    for i, line in enumerate(p.read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].replace(",", " ").split()
        if not parts:
            continue
        try:
            t = float(parts[0])
        except ValueError:
            raise RequestsError(f"requests.trace: {p}:{i}: {parts[0]!r} is not a time in seconds") from None
        if len(parts) > 2 or (len(parts) == 2 and parts[1] not in out):
            raise RequestsError(f"requests.trace: {p}:{i}: expected `T` or `T DEVICE` with DEVICE one of "
                                f"{', '.join(names)}")
        for name in ([parts[1]] if len(parts) == 2 else names):
            out[name].append(t)
    try:
        return {n: trace_arrivals(ts) for n, ts in out.items()}
    except ValueError as exc:
        raise RequestsError(f"requests.trace: {p}: {exc}") from None


def arrival_times(settings, names: list[str], seed: int) -> dict[str, list[float | None]]:
    """Per device, its requests' arrival times (None: closed loop)."""
    if settings.arrival == "trace":
        return load_trace(settings.trace, names)
    if settings.arrival == "poisson":
        return {n: poisson_arrivals(settings.rate_per_s, settings.count, device_rng(seed, n)) for n in names}
    return {n: closed_arrivals(settings.count) for n in names}


def request_queues(settings, names: list[str], prompts: list[list[int]], seed: int, write=None) -> RequestQueues:
    """The edge's request queues: per device its requests in arrival order, each with a prompt drawn from
    `prompts` (token ids of the prompt set, uniformly, seeded per device)."""
    if not prompts:
        raise RequestsError("requests.prompts: the prompt set is empty")
    seed = settings.seed if settings.seed is not None else seed
    plans = {}
    for name, times in arrival_times(settings, names, seed).items():
        draw = device_rng(seed, name, PROMPT_STREAM).integers(len(prompts), size=len(times))
        plans[name] = [Request(f"{name}/{i}", name, t, list(prompts[int(k)]), int(k), settings.max_new_tokens)
                       for i, (t, k) in enumerate(zip(times, draw))]
    return RequestQueues(plans, write=write)
