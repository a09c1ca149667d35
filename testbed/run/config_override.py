"""Overrides of a profile from the command line, checked against the schema before they are applied.

`--set KEY=VALUE` takes a dotted key (list entries by index or, for a list of named entries such as
``scenario.devices``, by name) and a YAML-typed value; the dedicated flags (`--rounds`, `--policy`,
`--channel`, `--seed`) are overrides too. Each `Override` remembers how the user wrote it, so that an
error names the flag (``--rounds 0: must be >= 1``), not the profile file, and an unknown key gets a
did-you-mean (``--set deadline=5: unknown key 'deadline'; did you mean deadline_s?``).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from testbed.runtime.errors import TestbedError, did_you_mean


class OverrideError(TestbedError, ValueError):
    """An override that cannot be applied; the message starts with the flag as the user wrote it."""


@dataclass(frozen=True)
class Override:
    """One override: dotted `key`, typed `value`, and `flag`, how the user wrote it (for errors)."""

    key: str
    value: Any
    flag: str


def split_key_value(text: str, flag: str, expected: str,
                    error: type[Exception] = OverrideError) -> tuple[str, str]:
    """'KEY=VALUE' -> (KEY stripped, VALUE as written): the one reader of the command line's KEY=VALUE
    arguments (`--set`, the `--sweep` of `campaign` and of `simulate`). Without '=' or with an empty KEY it
    raises `error` with the message ``<flag> '<text>': expected <expected>``."""
    key, sep, value = str(text).partition("=")
    key = key.strip()
    if not sep or not key:
        raise error(f"{flag} {text!r}: expected {expected}")
    return key, value


def split_values(text: str) -> list[str]:
    """'V1, V2,,V3' -> ['V1', 'V2', 'V3']: a sweep's comma-separated values, stripped, empty ones dropped."""
    return [item for item in (x.strip() for x in text.split(",")) if item]


def parse_set(items: list[str] | None) -> list[Override]:
    """`--set KEY=VALUE` items as overrides; VALUE is read as YAML (``5`` an int, ``[1, 2]`` a list,
    ``null`` None, ``'5'`` a string)."""
    out = []
    for item in items or []:
        key, text = split_key_value(item, "--set", "KEY=VALUE, e.g. --set deadline_s=5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0]
            raise OverrideError(f"--set {item}: the value is not valid YAML ({first}); quote it") from None
        out.append(Override(key, value, f"--set {item}"))
    return out


# -- the schema, walked by key ------------------------------------------------------------------------
# A schema node is a pydantic model class (fields known), ("list", item) or ("dict", value) (any key), or
# None (free-form: no checks below it).

def _node(annotation) -> Any:
    """The schema node of a field annotation (Optional and unions: the first structured member)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple) and args:
        return ("list", _node(args[0]))
    if origin is dict and len(args) == 2:
        return ("dict", _node(args[1]))
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            node = _node(arg)
            if node is not None:
                return node
    return None


def field_node(model: type[BaseModel], name: str) -> Any:
    """The schema node below `model.name`; a free-form mapping field that the model names in its
    ``MAPPING_SCHEMAS`` (a profile's ``scenario``) is checked against that schema."""
    schema = getattr(model, "MAPPING_SCHEMAS", {}).get(name)
    return schema if schema is not None else _node(model.model_fields[name].annotation)


def node_at(root: type[BaseModel], path: tuple) -> Any:
    """The schema node at a path of keys and list indexes (None where the schema is free-form)."""
    node: Any = root
    for part in path:
        if isinstance(node, type) and issubclass(node, BaseModel):
            if not isinstance(part, str) or part not in node.model_fields:
                return None
            node = field_node(node, part)
        elif isinstance(node, tuple):
            node = node[1]
        else:
            return None
    return node


def _index(seq: list, part: str, where: str, flag: str) -> int:
    """The list index that `part` names: an integer, or the `name` of an entry (devices by name)."""
    if part.lstrip("-").isdigit():
        i = int(part)
        if not -len(seq) <= i < len(seq):
            raise OverrideError(f"{flag}: index {i} is out of range: {where} has {len(seq)} entries "
                                f"(0..{len(seq) - 1})")
        return i % len(seq)
    names = [e.get("name") for e in seq if isinstance(e, dict)]
    if part in names:
        return names.index(part)
    shown = ", ".join(str(n) for n in names if n is not None) or "none named"
    raise OverrideError(f"{flag}: {where} has no entry {part!r}{did_you_mean(part, [n for n in names if n])} "
                        f"(give an index 0..{len(seq) - 1} or a name: {shown})")


def apply_override(data: dict, ov: Override, root: type[BaseModel]) -> tuple:
    """Set `ov` in the profile mapping `data` (in place) after checking its key against the schema of
    `root` (the run profile, or a scenario). Returns the canonical path (list entries as indexes), which names
    the override in validation errors."""
    parts = ov.key.split(".")
    if any(not p for p in parts):
        raise OverrideError(f"{ov.flag}: {ov.key!r} is not a dotted key (e.g. scenario.devices.0.distance_m)")
    cur: Any = data
    node: Any = root
    path: list = []
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(str(p) for p in path) or "the profile"
        if isinstance(cur, list):
            i = _index(cur, part, where, ov.flag)
            path.append(i)
            node = node[1] if isinstance(node, tuple) else None
            if last:
                cur[i] = ov.value
            else:
                cur = cur[i]
            continue
        if not isinstance(cur, dict):
            raise OverrideError(f"{ov.flag}: {where} is a value ({cur!r}), not a section with keys")
        if isinstance(node, type) and issubclass(node, BaseModel):
            if part not in node.model_fields:
                fields = list(node.model_fields)
                scope = f"under {where}" if path else "in a profile"
                hint = did_you_mean(part, fields) or f" (keys: {', '.join(fields)})"
                raise OverrideError(f"{ov.flag}: unknown key {part!r} {scope}{hint}")
            next_node = field_node(node, part)
        elif isinstance(node, tuple):
            next_node = node[1]
        else:
            next_node = None
        path.append(part)
        if last:
            cur[part] = ov.value
        else:
            if cur.get(part) is None:
                cur[part] = [] if isinstance(next_node, tuple) and next_node[0] == "list" else {}
            cur = cur[part]
        node = next_node
    return tuple(path)


def attribute(loc: tuple, applied: dict[tuple, Override]) -> Override | None:
    """The override that set `loc` (or a section above it, or a field below it), if any."""
    best = None
    for path, ov in applied.items():
        n = min(len(path), len(loc))
        if path[:n] == loc[:n] and (best is None or len(path) > len(best[0])):
            best = (path, ov)
    return best[1] if best else None


def rule(err: dict, root: type[BaseModel] | None = None) -> str:
    """What a pydantic error requires, in the words of the rest of the CLI (e.g. 'must be >= 1')."""
    t, ctx, msg = err["type"], err.get("ctx") or {}, err["msg"]
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if t in bounds:
        key = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}[t]
        return f"must be {bounds[t]} {ctx.get(key)}"
    if t == "missing":
        return "required field is missing"
    if t == "literal_error":
        expected = str(ctx.get("expected", ""))
        choices = [c.strip().strip("'\"") for c in expected.replace(" or ", ",").split(",") if c.strip()]
        return f"must be one of {expected}{did_you_mean(err.get('input'), choices)}"
    if t == "extra_forbidden":
        node = node_at(root, tuple(err["loc"][:-1])) if root is not None else None
        names = list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []
        return "unknown field" + (did_you_mean(err["loc"][-1], names) if names else " (check the spelling)")
    return msg.replace("Input should be", "must be").replace("Value error, ", "")


def loc_text(loc: tuple) -> str:
    """A location as the scenario errors write it: ``scenario.devices[0].acceptance``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("function-"):
            out += ("." if out else "") + str(part)
    return out or "(profile)"


def policy_list(text: str, flag: str = "--policies") -> list[str]:
    """A comma-separated list of policy names (one for --policy); an unknown one gets a did-you-mean."""
    from testbed.runtime.plugins import PluginError, check_policy, policy_names

    policies = [p.strip() for p in str(text).split(",") if p.strip()]
    if not policies:
        raise OverrideError(f"{flag} {text!r}: name at least one policy (allowed: {', '.join(policy_names())})")
    for p in policies:
        try:
            check_policy(p, f"unknown policy {p!r}" if len(policies) > 1 else "unknown policy")
        except PluginError as exc:
            raise OverrideError(f"{flag} {text}: {exc}") from None
    if len(set(policies)) != len(policies):
        raise OverrideError(f"{flag} {text}: a policy is listed twice")
    return policies


def fixed_length_notes(fixed_length: int | None, policies: list[str], max_draft_len: int,
                       given: str | None = None) -> list[str]:
    """Warnings for a draft length the user gave that will not be used as given: clamped to L_max, or
    ignored by every policy asked for (only `fixed-length` reads it). None (not given) warns of nothing;
    `given` is how the user wrote it (default: --fixed-length N)."""
    if fixed_length is None:
        return []
    from testbed.core.optimizer import POLICIES

    given = given or f"--fixed-length {fixed_length}"
    if "fixed-length" not in policies and all(p in POLICIES for p in policies):  # a plug-in may read it
        return [f"{given} is ignored: only the fixed-length policy uses it (policies here: {', '.join(policies)})"]
    if fixed_length > max_draft_len:
        return [f"{given} is clamped to max_draft_len {max_draft_len} (the scenario's L_max)"]
    return []
