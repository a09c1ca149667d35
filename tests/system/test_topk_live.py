"""Top-k uploads in live runs on the micro pair (real device processes, the channel emulator, the edge):
the bytes of every UL-mode upload's distributions against the model's payload, acceptance per k, and UL ==
DL tokens under the same seeds. Every run starts its processes through `testbed.run.launcher` (stopped by pid)."""

from __future__ import annotations

import json

from support import profile_data

from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_run


def _profile(pair, scenario: dict, **overrides):
    data = profile_data(pair, **{"rounds": 12, "on_air_vocab_size": 151936, **overrides})  # b_id = 18 on the air
    data["scenario"] = {**data["scenario"], "uplink_bandwidth_hz": 1e6, **scenario}
    return load_profile(data)


def test_top_k_chosen_live_uploads_the_model_payload_and_reports_acceptance_per_k(micro_pair, tmp_path):
    run_dir = tmp_path / "run"
    summary = run_live(_profile(micro_pair, {"topk_choices": [16, 64]}), run_dir, progress=False)
    meta, records = load_run(run_dir)
    assert meta["status"] == "complete" and len(records) == 12
    used, uploads = set(), 0
    for rec in records:
        k = rec["payload"]["k"]
        assert {o["k"] for o in rec["payload"]["options"]} == {None, 16, 64} and k in (None, 16, 64)
        used.add(k)
        for name, d in rec["devices"].items():
            assert d["topk_k"] == k and not d["missed"]
            est = d["estimate"]["alpha_topk"]
            assert set(est) == {"16", "64"} and all(0 < a < 1 for a in est.values())
            if d["mode"] != "UL":
                assert d["measured"]["q_bytes"] == 0
                continue
            uploads += 1
            # The distributions' bytes on the air: exactly L x k (b_id + b_p) / 8 (dense: L V b_p / 8), the
            # model's; the rest of the charged upload is the header and the int32 ids (ul_unmodeled_bits).
            want = d["draft_len"] * (151936 * 16 if k is None else k * (18 + 16)) / 8
            assert d["measured"]["q_bytes"] == d["predicted"]["q_bytes"] == want, (rec["round"], name)
            charged = d["measured"]["ul_bytes"]
            assert charged == d["ul_channel"]["bytes"] and charged > want
            assert abs(d["measured"]["ul_unmodeled_bits"]) < 8 * 300  # the header's JSON beyond the fitted H
    assert uploads > 0 and used & {16, 64}  # a 1 MHz uplink: top-k rounds
    # Acceptance per k (the draft distribution each round used) in the summary, per device too.
    pay = summary["payload"]
    assert set(pay) == {"dense" if k is None else str(k) for k in used}
    for s in pay.values():
        assert s["device_rounds"] > 0 and 0 <= s["acceptance_rate"] <= 1 and set(s["devices"]) == {"d0", "d1"}
        assert s["q_bytes"] == s["q_bytes_model"]
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["payload"].keys() == pay.keys()


def test_ul_and_dl_give_identical_text_with_top_k(micro_pair, tmp_path):
    texts = {}
    for mode in ("UL", "DL"):
        run_dir = tmp_path / mode
        run_live(_profile(micro_pair, {"payload_format": "topk", "topk_k": 16}, rounds=8,
                          pin={"mode": mode, "draft_len": 4}), run_dir, progress=False)
        _, records = load_run(run_dir)
        assert all(d["mode"] == mode and d["topk_k"] == 16 for r in records for d in r["devices"].values())
        texts[mode] = json.loads((run_dir / "outputs.json").read_text())
    for name in ("d0", "d1"):
        assert texts["UL"][name]["output_ids"] == texts["DL"][name]["output_ids"], name
        assert len(texts["UL"][name]["output_ids"]) >= 8
    assert any(texts["DL"][n]["accepted"] < texts["DL"][n]["drafted"] for n in texts["DL"])  # corrections ran
