"""Reading a scenario from a YAML file (the core's `Scenario` itself never touches files)."""

from __future__ import annotations

from pathlib import Path

import yaml

from testbed.core.scenario import Scenario, ScenarioError


def load_scenario(path_or_dict: str | Path | dict) -> Scenario:
    """A validated `Scenario` from a mapping or a YAML file; errors name the file and the field."""
    if isinstance(path_or_dict, dict):
        return Scenario.from_dict(path_or_dict)
    p = Path(path_or_dict)
    if not p.is_file():
        raise ScenarioError(f"scenario file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{p}: not valid YAML: {exc}") from None
    return Scenario.from_dict(data, source=str(p))
