"""A run's requests (testbed.run.requests, profile `requests:`): prompt sets, traces, the queues handed to the
edge, and the profile's checks. No processes: what the run builds before anything starts."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from testbed.run.profile import ProfileError, load_profile
from testbed.run.requests import RequestsError, load_prompt_set, load_trace, request_queues

SCENARIO = {"bits_per_prob": 16, "max_draft_len": 4,
            "devices": [{"name": f"d{i}", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.6}
                        for i in range(2)]}


def _profile(**requests):
    return load_profile({"scenario": SCENARIO, "requests": requests})


def test_prompt_sets(tmp_path):
    shipped = load_prompt_set("shipped")
    assert len(shipped) >= 5 and all(shipped)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n\n{"text": "c"}\n"d"\n')
    assert load_prompt_set(str(jsonl)) == ["a b", "c", "d"]
    jsonl.write_text('{"question": "q1"}\n')
    assert load_prompt_set(str(jsonl), "question") == ["q1"]
    with pytest.raises(RequestsError, match=r"p.jsonl:1: no text in field 'prompt'"):
        load_prompt_set(str(jsonl))
    txt = tmp_path / "p.txt"
    txt.write_text("# comment\none\\ntwo\n\nthree\n")
    assert load_prompt_set(str(txt)) == ["one\ntwo", "three"]
    with pytest.raises(RequestsError, match="not a file"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed here")
def test_a_hugging_face_dataset_without_datasets_is_a_clear_error():
    with pytest.raises(RequestsError, match=r"hf:some/set needs the `datasets` package"):
        load_prompt_set("hf:some/set")


def test_traces(tmp_path):
    trace = tmp_path / "t.txt"
    trace.write_text("# t device\n0.5\n0.2, d1\n1.5 d0\n")
    assert load_trace(str(trace), ["d0", "d1"]) == {"d0": [0.5, 1.5], "d1": [0.2, 0.5]}
    trace.write_text("0.5 d9\n")
    with pytest.raises(RequestsError, match=r"t.txt:1: expected `T` or `T DEVICE`"):
        load_trace(str(trace), ["d0", "d1"])
    trace.write_text("soon\n")
    with pytest.raises(RequestsError, match="'soon' is not a time"):
        load_trace(str(trace), ["d0"])


def test_queues_draw_prompts_and_arrivals_per_device():
    prof = _profile(arrival="poisson", rate_per_s=2.0, count=5, max_new_tokens=7)
    prompts = [[1, 2], [3], [4, 5, 6]]
    q = request_queues(prof.requests, ["d0", "d1"], prompts, seed=prof.seed)
    again = request_queues(prof.requests, ["d0", "d1"], prompts, seed=prof.seed)
    for name in ("d0", "d1"):
        reqs = q.waiting[name]
        assert [r.id for r in reqs] == [f"{name}/{i}" for i in range(5)]
        assert all(r.max_new_tokens == 7 and r.prompt_ids == prompts[r.prompt_index] for r in reqs)
        times = [r.arrival_s for r in reqs]
        assert times == sorted(times) and times[0] > 0
        assert times == [r.arrival_s for r in again.waiting[name]]
    assert [r.arrival_s for r in q.waiting["d0"]] != [r.arrival_s for r in q.waiting["d1"]]
    closed = request_queues(_profile(count=2).requests, ["d0"], prompts, seed=0)
    assert [r.arrival_s for r in closed.waiting["d0"]] == [None, None]


def test_profile_checks(tmp_path):
    assert load_profile({"scenario": SCENARIO}).requests is None  # as before: one prompt per device
    assert _profile().requests.arrival == "closed"
    for bad, msg in ((dict(arrival="poisson"), "poisson needs rate_per_s"),
                     (dict(rate_per_s=2.0), "rate_per_s applies to arrival: poisson"),
                     (dict(arrival="trace"), "trace needs trace"),
                     (dict(max_new_tokens=0), "requests.max_new_tokens"),
                     (dict(arrival="bursty"), "requests.arrival")):
        with pytest.raises(ProfileError, match=msg):
            _profile(**bad)
    with pytest.raises(ProfileError, match="needs synchronous rounds"):
        load_profile({"scenario": {**SCENARIO, "rounds": "asynchronous"}, "channel": {"mode": "real"},
                      "requests": {}})
    with pytest.raises(ProfileError, match="set requests.max_new_tokens instead"):
        load_profile({"scenario": SCENARIO, "max_new_tokens": 5, "requests": {}})
    # Relative paths in a profile file resolve against its folder.
    (tmp_path / "trace.txt").write_text("0\n")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"scenario": SCENARIO, "requests": {"arrival": "trace", "trace": "trace.txt",
                                                                        "prompts": "p.jsonl"}}))
    req = load_profile(path).requests
    assert req.trace == str(tmp_path / "trace.txt") and req.prompts == str(tmp_path / "p.jsonl")
