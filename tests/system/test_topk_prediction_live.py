"""Top-k acceptance modelled by default (issue 29, item 3), live on the default embedded pair: with
`topk_choices` and no `topk_acceptance_ratio` the run calibrates alpha_k / alpha before round 0, the plan
chooses k on it, and the chosen k's measured goodput lands within 15% of its prediction over the run.

Real processes (the edge, the channel emulator, device processes), stopped by pid by the launcher. The
round times are the host's: on a host loaded far beyond its cores the rounds stall beyond the model's median
timings and the goodput ratio drops below 0.85 while the tokens' ratio holds (measured: docs/system-model.md,
section 3)."""

from __future__ import annotations

import pytest
import yaml

from testbed import PROFILES_DIR
from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_run


def _profile(**scenario):
    data = yaml.safe_load((PROFILES_DIR / "emulation.yaml").read_text())
    # two of its devices: fewer processes on the host, whose stalls the model does not know of
    data.update(rounds=40, seed=3, hardware={n: data["hardware"][n] for n in ("dev0", "dev1")})
    data["scenario"] = {**data["scenario"], "payload_format": "topk", "topk_choices": [16, 64, 256],
                        "devices": data["scenario"]["devices"][:2], **scenario}
    return load_profile(data)


def by_k(records: list[dict]) -> dict:
    """k -> (rounds, measured/predicted tokens, measured/predicted goodput: tokens / round time summed)."""
    out: dict = {}
    for rec in records:
        out.setdefault(rec["payload"]["k"], []).append(rec)
    ratios = {}
    for k, rs in out.items():
        pt, mt = (sum(r[side]["tokens"] for r in rs) for side in ("predicted", "measured"))
        ps, ms = (sum(r[side]["round_s"] for r in rs) for side in ("predicted", "measured"))
        ratios[k] = (len(rs), mt / pt, (mt / ms) / (pt / ps))
    print("k -> (rounds, measured/predicted tokens, measured/predicted goodput):", ratios)
    return ratios


@pytest.mark.slow  # 20-45 s a run: the default pair's 40 rounds with real processes
def test_the_chosen_k_goodput_is_predicted_within_15_percent(tmp_path):
    seen = []
    for attempt in range(2):  # a host loaded far beyond its cores stalls one run's rounds; a real miss fails both
        run_dir = tmp_path / f"run{attempt}"
        run_live(_profile(), run_dir, progress=False)
        meta, records = load_run(run_dir)
        cal = meta["calibration"]["topk"]
        # measured on the pair: every k loses acceptance, the fewer entries the more
        r = {int(k): v for k, v in cal["ratio"].items()}
        assert 0 < r[16] < r[64] < r[256] < 1.0 and cal["positions"] >= 64
        ratios = by_k(records)
        k, (rounds, tokens, goodput) = max(ratios.items(), key=lambda kv: kv[1][0])  # the k chosen most
        assert k is not None and rounds >= 20, ratios
        seen.append(ratios)
        if abs(tokens - 1) < 0.15 and abs(goodput - 1) < 0.15:
            return
    raise AssertionError(f"the chosen k's measured / predicted (rounds, tokens, goodput) in both runs: {seen}")
