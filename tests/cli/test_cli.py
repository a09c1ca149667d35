import subprocess
import sys

from support import ROOT

from testbed.cli import build_parser


def test_version_and_unknown_command():
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("multispin ")
    bad = subprocess.run([sys.executable, "-m", "testbed.cli", "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_every_registered_command_has_a_handler():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices, "no subcommands registered"
    for name, subparser in sub.choices.items():
        assert subparser.get_default("handler") is not None or subparser._subparsers is not None, name


def test_library_errors_exit_2_without_a_traceback(tmp_path, capsys):
    # A TestbedError raised in the library (here: the launcher's check of a local pair) is the CLI's exit 2.
    import yaml

    from testbed.cli import main

    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({
        "model": {"pair": "local", "target": str(tmp_path / "no-target"), "draft_onnx": str(tmp_path / "d.onnx"),
                  "tokenizer": str(tmp_path / "tok.json")},
        "scenario": {"devices": [{"name": "d0", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.6}]},
    }))
    assert main(["run", str(prof), "--runs-dir", str(tmp_path / "runs"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "multispin run: error: model.target:" in err and "Traceback" not in err


def test_command_errors_exit_2_also_under_python_m(tmp_path):
    # Under `python -m testbed.cli` the commands' CliError is a second class; it is still caught.
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "plan", str(tmp_path / "none.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("multispin plan: error:"), out.stderr


def test_library_code_never_raises_or_imports_the_cli_error():
    # The library raises testbed.runtime.errors.TestbedError; only the command line (testbed/cli/) imports it.
    import ast

    root = ROOT
    library = [p for pkg in ("testbed", "edge_node", "device_node", "channel_emulator", "model_pairs")
               for p in (root / pkg).rglob("*.py") if p.relative_to(root).parts[:2] != ("testbed", "cli")]
    bad = []
    for path in library:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(root)}:{node.lineno}" for m in mods if m == "testbed.cli"]
    assert library and bad == []


def test_device_help_lists_the_exit_codes():
    from device_node.options import ExitCode

    out = subprocess.run([sys.executable, "-m", "testbed.cli", "device", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    epilog = out.stdout[out.stdout.index("exit codes:"):]
    for code in ExitCode:
        assert f"\n  {int(code)}  " in epilog, code


def test_device_with_a_missing_draft_exits_with_usage(tmp_path):
    from device_node.options import ExitCode

    out = subprocess.run([sys.executable, "-m", "device_node.node", "--connect", f"ipc://{tmp_path}/e",
                          "--name", "d0", "--draft", str(tmp_path / "none.onnx")], capture_output=True, text=True)
    assert out.returncode == ExitCode.USAGE and "none.onnx" in out.stderr
