"""The emulator's `reset` request (a warm pool's next trial, `testbed.run.warm`): statistics, counters, links and
mode as a freshly started emulator has them, the devices' connections kept (a real emulator process)."""

import pytest
from support import Bench

from testbed.wire.protocol import decode_header, encode_header


@pytest.fixture
def bench(tmp_path):
    b = Bench(tmp_path)
    yield b
    b.close()


def test_reset_gives_a_fresh_emulators_state_and_keeps_the_connections(bench):
    fresh = bench.control.stats()
    d = bench.device("dev-a")
    bench.control.configure(round=5, links={"dev-a": {"ul_rate_bps": 1e6}}, mode="virtual")
    d.send_multipart([encode_header({"type": "draft", "air": "ul"}), bytes(1000)])
    bench.edge.recv_multipart()
    used = bench.control.stats()
    assert used["counters"]["charged"] == 1 and used["links"] and used["round"] == 5 and used["mode"] == "virtual"

    assert bench.control.reset() == {"ok": True}
    after = bench.control.stats()
    assert after["counters"] == fresh["counters"] and after["links"] == fresh["links"] == {}
    assert (after["round"], after["mode"]) == (fresh["round"], fresh["mode"])
    # The same device connection goes on, uncharged until the next configure.
    d.send_multipart([encode_header({"type": "draft", "air": "ul"}), bytes(1000)])
    ident, hdr, _ = bench.edge.recv_multipart()
    channel = decode_header(hdr)["channel"]
    assert ident == b"dev-a" and channel["rate_bps"] is None and channel["mode"] == "real" and channel["round"] is None
    assert bench.control.stats()["counters"]["unconfigured"] == 1
