"""docs/profile-reference.md is generated from the profile's schema (`testbed.run.profile_reference`) and kept
current: regenerated here and compared, so a schema change without `python tools/gen_profile_reference.py`
fails. Every key of every section is in it with its type, default and meaning."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from testbed.channel.config import ChannelStateSettings
from testbed.core.scenario import Device, DropSpec, Scenario
from testbed.run import profile_reference as ref
from testbed.run.profile import ChannelSettings, EstimatorSettings, Profile


def _tool():
    spec = importlib.util.spec_from_file_location("gen_profile_reference",
                                                  Path(ref.__file__).parents[2] / "tools" / "gen_profile_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_reference_is_what_the_schema_generates():
    assert ref.DOC.read_text() == ref.reference_markdown(), \
        "docs/profile-reference.md is stale: run python tools/gen_profile_reference.py"


def test_the_check_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "profile-reference.md"
    stale.write_text(ref.reference_markdown().replace("`deadline_s`", "`deadline`"))
    monkeypatch.setattr(ref, "DOC", stale)
    assert _tool().main(["--check"]) == 1 and "out of date" in capsys.readouterr().err
    assert _tool().main([]) == 0 and _tool().main(["--check"]) == 0


def test_every_key_of_every_section_has_a_row_with_type_default_and_meaning():
    rows = {}
    for line in ref.reference_markdown().splitlines():
        m = re.match(r"\| `([^`]+)` \| (.+?) \| (.*?) \| (.+?) \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    sections = [("", Profile), ("channel.", ChannelSettings), ("estimator.", EstimatorSettings),
                ("scenario.", Scenario), ("scenario.devices[].", Device), ("scenario.drop.", DropSpec),
                ("channel.state.", ChannelStateSettings)]
    for prefix, model in sections:
        for name in model.model_fields:
            if prefix == "scenario." and name in ("devices", "drop"):
                continue  # their own sections
            kind, _, default, meaning = rows[prefix + name]
            assert kind and default and meaning.strip(), prefix + name
    assert rows["scenario.payload_format"][0] == "`dense` \\| `topk`"
    assert rows["deadline_s"][1:3] == ("> 0", "10")
    assert rows["scenario.devices[].acceptance"][1:3] == ("> 0, < 1", "required")
    assert {"threshold_db", "p_good_to_bad"} <= set(rows)  # the example plug-ins' parameters
    assert "Why pydantic v2" in ref.reference_markdown()
