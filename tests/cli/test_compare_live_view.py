"""`multispin compare --live-view`: every run of the comparison in one live view, each under its own title and
counted from its own first round; the comparison's table is written as without the view."""

from __future__ import annotations

import json

import yaml
from support import profile_data

from testbed.cli import main


def test_a_comparison_in_the_live_view_shows_each_run_under_its_own_title(micro_pair, tmp_path, capsys):
    profile = tmp_path / "micro.yaml"
    profile.write_text(yaml.safe_dump(profile_data(micro_pair, rounds=2, model={
        "pair": "local", "target": str(micro_pair.target_dir), "draft_onnx": str(micro_pair.draft_onnx),
        "tokenizer": str(micro_pair.tokenizer), "threads": 1})))
    rc = main(["compare", str(profile), "--policies", "all-ul,all-dl", "--runs-dir", str(tmp_path / "cmp"),
               "--no-plots", "--live-view"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    # The view's last frame: the second run, counted from its own first round
    assert "compare all-dl" in printed and "round 1/2" in printed
    table = json.loads(next((tmp_path / "cmp").glob("*/compare.json")).read_text())
    assert [row["policy"] for row in table["per_policy"]] == ["all-ul", "all-dl"]
    assert all(row["runs"] == 1 for row in table["per_policy"])
