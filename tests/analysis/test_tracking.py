"""Tracking exports (issue 31): a real campaign (the default pair, one device, 2 rounds, virtual channel) into
an MLflow file store, opened again with the MLflow client, and into TensorBoard event files, read back; plus
`multispin runs --tag`. The extras are optional: without them the export says which extra to install."""

from __future__ import annotations

import json

import pytest

from testbed.cli import main

pytestmark = pytest.mark.live  # one short live campaign, shared by the module


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    out = tmp_path_factory.mktemp("track") / "camp"
    assert main(["campaign", "--sweep", "devices=1", "--policies", "all-ul,all-dl", "--rounds", "2", "--channel",
                 "virtual", "--out", str(out), "--tag", "paper", "--note", "first try", "--no-plots", "--quiet"]) == 0
    return out


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_mlflow_export_opens_with_the_mlflow_client(campaign, tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    assert main(["export", str(campaign), "--to", "mlflow", "--out", str(store), "--experiment", "grid"]) == 0
    assert "2 run(s) exported, 0 there already" in capsys.readouterr().out
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store opt-in, as a reader sets it
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name("grid")
    runs = {r.data.tags.get("mlflow.runName"): r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"camp", "devices=1/all-ul", "devices=1/all-dl"}
    parent = runs.pop("camp")
    assert parent.data.params["sweep.devices"] == "1"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"results.csv", "campaign.json"}
    for name, run in runs.items():
        s = _summary(campaign / name)
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.params["policy"] == name.split("/")[1] and run.data.params["sweep.devices"] == "1"
        assert run.data.tags["multispin.tags"] == "paper" and run.data.tags["mlflow.note.content"] == "first try"
        assert run.data.metrics["measured_goodput_tps"] == pytest.approx(s["goodput_run_tps"]["measured"])
        history = client.get_metric_history(run.info.run_id, "round/measured_goodput_tps")
        assert [m.step for m in history] == [0, 1]
        assert run.info.status == "FINISHED"
    # Again: nothing doubled.
    assert main(["export", str(campaign), "--to", "mlflow", "--out", str(store), "--experiment", "grid"]) == 0
    assert "0 run(s) exported, 2 there already" in capsys.readouterr().out
    assert len(client.search_runs([exp.experiment_id])) == 3


def test_tensorboard_export_reads_back(campaign, tmp_path):
    pytest.importorskip("tensorboardX")
    from testbed.analysis.tracking import read_scalars

    logdir = tmp_path / "tb"
    for _ in range(2):  # a second export replaces the first, it does not double it
        assert main(["export", str(campaign), "--to", "tensorboard", "--out", str(logdir)]) == 0
    run = campaign / "devices=1" / "all-dl"
    scalars = read_scalars(logdir / "camp" / "devices=1" / "all-dl")
    records = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    assert [s for s, _ in scalars["round/measured_goodput_tps"]] == [0, 1]
    assert [v for _, v in scalars["round/predicted_round_s"]] == pytest.approx(
        [r["predicted"]["round_s"] for r in records], rel=1e-6)  # float32 in the event file
    assert scalars["run/measured_goodput_tps"][0][1] == pytest.approx(
        _summary(run)["goodput_run_tps"]["measured"], rel=1e-6)


def test_runs_filters_by_tag(campaign, capsys):
    assert main(["runs", str(campaign / "devices=1"), "--tag", "paper", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert main(["runs", str(campaign / "devices=1"), "--tag", "other"]) == 0
    assert "no runs" in capsys.readouterr().out


def test_a_missing_folder_is_named(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--to", "tensorboard", "--out", str(tmp_path / "tb")]) == 2
    assert "nope: not a run, compare or campaign folder" in capsys.readouterr().err
