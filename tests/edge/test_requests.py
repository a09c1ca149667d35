"""Request serving at the edge (edge_node.requests) with scripted devices: each request a new session on its
device (a fresh verifier context), served to its token limit; closed-loop and timed arrivals; queued requests
wait; a device idle between requests keeps its session; no KV cache is left behind."""

from __future__ import annotations

import pytest
from support import ScriptedDevice, make_server

from edge_node.requests import Request, RequestQueues

pytestmark = pytest.mark.live  # the edge on real sockets

MAX_NEW = 6


@pytest.fixture
def ipc(tmp_path):
    return f"ipc://{tmp_path}/edge"


def _serve(ipc, plans: dict[str, list[Request]], rounds: int = 200, **server_kw):
    server = make_server(ipc, names=tuple(plans), deadline_s=3.0, **server_kw)
    server.requests = RequestQueues(plans)
    devices = [ScriptedDevice(ipc, name) for name in plans]
    try:
        for d in devices:
            d.start()
        assert server.wait_for_devices(list(plans), 10.0) == []
        records = server.run(rounds)
        left = dict(server.sessions)
        server.finish("done")
        for d in devices:
            d.join(5)
    finally:
        for d in devices:
            d.stop.set()
        server.close()
    return server, records, left, devices


def _reqs(name: str, times: list[float | None]) -> list[Request]:
    return [Request(f"{name}/{i}", name, t, [5 + i, 6], i, MAX_NEW) for i, t in enumerate(times)]


def test_closed_loop_requests_are_fresh_sessions_served_one_after_another(ipc):
    server, records, left, devices = _serve(ipc, {"dev0": _reqs("dev0", [None] * 3),
                                                  "dev1": _reqs("dev1", [None] * 2)})
    done = server.requests.done
    assert server.requests.all_done and len(done) == 5 and len(records) < 200  # ended when all were served
    assert all(r["finished"] and r["output_tokens"] == MAX_NEW for r in done)
    for name, n in (("dev0", 3), ("dev1", 2)):
        mine = [r for r in done if r["device"] == name]
        assert [r["id"] for r in mine] == [f"{name}/{i}" for i in range(n)]
        assert mine[0]["arrival_s"] == 0.0
        for a, b in zip(mine, mine[1:]):  # closed loop: the next arrives as the previous completes
            assert b["arrival_s"] >= a["last_token_s"] and b["start_s"] >= b["arrival_s"]
        assert all(r["ttft_s"] >= r["queue_s"] >= 0 for r in mine)
    # Every request had a session of its own, and none is left open in the verifier.
    assert len({r["session"] for r in done}) == 5 and not server.verifier.open_sids
    assert all(s.idle and not s.done for s in left.values())
    assert [d.bye for d in devices] == ["done", "done"]  # the bye came at the end, not per request
    # Each request's prompt reached its device: the last registered prompt is the last request's.
    assert list(devices[0].registered.prompt_ids) == [7, 6]


def test_timed_arrivals_wait_for_their_time_and_for_the_device(ipc):
    # dev0: a second request 1.5 s in, past the 0.6 s liveness window of an idle device; dev1: two at once.
    server, _, left, devices = _serve(ipc, {"dev0": _reqs("dev0", [0.0, 1.5]), "dev1": _reqs("dev1", [0.0, 0.0])})
    done = {r["id"]: r for r in server.requests.done}
    assert len(done) == 4 and all(r["finished"] for r in done.values())
    assert done["dev0/1"]["start_s"] >= 1.5 and done["dev0/1"]["queue_s"] < 0.5
    first, second = done["dev1/0"], done["dev1/1"]
    assert second["start_s"] >= first["last_token_s"]  # it waited for the device ...
    assert second["queue_s"] > 0 and second["ttft_s"] > second["queue_s"]  # ... and TTFT counts the wait
    assert set(left) == {"dev0", "dev1"}  # dev0 idled 1.5 s and kept its session (heartbeats went on)
    assert not any("not registered" in e for d in devices for e in d.errors)


def test_requests_the_rounds_did_not_finish_are_recorded_unfinished(ipc):
    server, records, _, _ = _serve(ipc, {"dev0": _reqs("dev0", [None, None])}, rounds=1)
    assert len(records) == 1 and not server.requests.done
    server.requests.close()  # as the run does at its end
    first, second = server.requests.done
    assert (first["id"], first["finished"]) == ("dev0/0", False) and 0 < first["output_tokens"] < MAX_NEW
    assert 0 < first["ttft_s"] <= first["e2e_s"]  # its tokens so far were timed (not in the percentiles)
    assert (second["id"], second["finished"], second["start_s"], second["output_tokens"]) == ("dev0/1", False,
                                                                                              None, 0)
