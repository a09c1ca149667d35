"""docs/profile-reference.md, generated from the profile's schema (`reference_markdown`).

Every section and key of a run profile (`testbed.run.profile.Profile`), of its `scenario:` (`testbed.core.
scenario.Scenario`, its devices and drop), of `channel.state` (`testbed.channel.config.ChannelStateSettings`)
and the parameters of the example plug-ins: type or allowed values, range, default and meaning, all read from
the pydantic models, so the reference cannot drift from what `load_profile` checks. A key's meaning is its
Field description, else the comment right above it (or beside it) in the model's source.
`tools/gen_profile_reference.py` writes the file; tests/run/test_profile_reference.py fails when it is stale.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

DOC = Path(__file__).resolve().parents[2] / "docs" / "profile-reference.md"
EXAMPLE_PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "ge_threshold"

INTRO = """# Profile reference

Generated from the profile's schema by `python tools/gen_profile_reference.py` (`testbed/run/profile_reference.py`);
do not edit by hand: `tests/run/test_profile_reference.py` fails when this file differs from the schema.

A run profile (`profiles/*.yaml`, `multispin run PROFILE`) is checked whole when it loads, before any process
starts or any run directory is made: an unknown key or a value outside its type or range ends the command with
exit status 2 and a line naming the key, the value, the rule and the nearest valid key
(`--set deadline=5: unknown key 'deadline' in a profile; did you mean deadline_s?`). `--set KEY=VALUE` reaches
every key below (dotted; list entries by index, `scenario.devices` also by name).

**Why pydantic v2.** One library checks everything: the profile, its scenario, the channel state, plug-in
parameters declared as pydantic models, and the wire's registration; each error carries its location (the
path of keys), which becomes the key named in the message and the nearest-key hint; the models export JSON
schema (`Profile.model_json_schema()`) and are the single source of this reference. jsonschema would check
the data but not build the typed objects the code uses, and hand-written checks were what let keys be ignored.

Columns: **type** (allowed values are listed as `a` \\| `b`), **range** (bounds a number must meet),
**default** (`required`: no default), **meaning**.
"""


def _source_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment lines right above its line in the class body, or the comment on its line."""
    try:
        src = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        beside = lines[node.end_lineno - 1].split("  # ", 1)
        text = " ".join(above) or (beside[1].strip() if len(beside) == 2 else "")
        out[node.target.id] = text
    return out


def type_text(annotation) -> str:
    """A field's type in words: allowed values of a Literal, `| null` for an optional one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, tuple) and args:
        return f"list of {type_text(args[0])}" + (f" ({len(args)} items)" if origin is tuple and args[-1] is not
                                                  Ellipsis else "")
    if origin is dict and args:
        return f"mapping {type_text(args[0])} -> {type_text(args[1])}"
    if args:
        parts = [type_text(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section (below)"
    return {"float": "number", "int": "integer", "str": "string", "bool": "true \\| false", "Any": "any"}.get(
        getattr(annotation, "__name__", str(annotation)), str(annotation))


def range_text(field) -> str:
    """The numeric bounds and lengths of a field (`ge 0`, `gt 0, le 1`, ...); empty without any."""
    parts = []
    for m in field.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >=")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{word} {v:g}" if isinstance(v, float) else f"{word} {v}")
    return ", ".join(parts)


def default_text(field) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("shown_default"):
        return str(extra["shown_default"])
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:g}" if isinstance(v, (int, float)) else str(v) for v in value) + "]"
    if isinstance(value, dict) and not value:
        return "{}"
    return f"`{value}`"


def own_doc(model) -> str:
    """A model's own docstring (not the one pydantic's BaseModel lends it), cleaned; "" without one."""
    doc = model.__dict__.get("__doc__") if model is not None else None
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _nested(annotation) -> tuple[type[BaseModel] | None, str]:
    """(the model a field holds, the key part under it: "" for the model itself, ".<name>" for a mapping of
    them), or (None, "")."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if typing.get_origin(annotation) is dict:
        model, _ = _nested(typing.get_args(annotation)[1])
        return model, ".<name>" if model is not None else ""
    if typing.get_origin(annotation) in (list, tuple):
        return None, ""
    for a in typing.get_args(annotation):
        model, under = _nested(a)
        if model is not None:
            return model, under
    return None, ""


def model_rows(model: type[BaseModel], prefix: str = "", skip: tuple = ()) -> tuple[list, list]:
    """(rows of this model's keys, [(prefix, nested model)] of its sections): a row is (key, type, range,
    default, meaning)."""
    comments = _source_comments(model)
    rows, sections = [], []
    for name, f in model.model_fields.items():
        if name in skip:
            continue
        nested, under = _nested(f.annotation)
        meaning = (f.description or comments.get(name, "") or own_doc(nested)
                   or (f"the section `{prefix + name + under}` below" if nested is not None else ""))
        if nested is not None:
            sections.append((prefix + name + under, nested))
        kind = type_text(f.annotation).replace(" \\| null \\| null", " \\| null")
        rows.append((prefix + name, kind, range_text(f), default_text(f), meaning))
    return rows, sections


def table(rows: list) -> list[str]:
    lines = ["| key | type | range | default | meaning |", "|---|---|---|---|---|"]
    for key, kind, rng, default, meaning in rows:
        cells = (f"`{key}`", kind, rng, default, meaning.replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _model_sections(title: str, model: type[BaseModel], prefix: str, intro: str = "",
                    skip: tuple = ()) -> list[str]:
    """A section per model, then one per nested model (depth first)."""
    rows, nested = model_rows(model, prefix, skip)
    doc = intro or own_doc(model)
    out = [f"## {title}", ""] + ([doc, ""] if doc else [])
    out += table(rows) + [""]
    for key, sub in nested:
        out += _model_sections(f"`{key}`", sub, key + ".")
    return out


def plugin_sections() -> list[str]:
    """Plug-in settings: where a plug-in's parameters go, and the example plug-ins' declared `Params`."""
    from testbed.runtime.plugins import declared_params

    out = ["## Plug-in settings", "",
           "A plug-in policy (`policy: module:Class` or an installed entry point) and a plug-in channel source "
           "(`channel.state.source`) declare their parameters as a class attribute `Params`: a dict of defaults or "
           "a pydantic model. The profile gives them under `policy_params: {POLICY: {PARAM: VALUE}}` and "
           "`channel.state.params: {PARAM: VALUE}`; each is checked against the declaration when the profile "
           "loads (an unknown parameter or a bad value: exit 2 naming the plug-in and the parameter), the "
           "defaults filled in. `multispin plugins` lists the plug-ins found. The example plug-ins "
           "(`examples/ge_threshold`, [extending.md](extending.md)):", ""]
    sys.path.insert(0, str(EXAMPLE_PLUGINS))
    try:
        from ge_threshold.channels import GilbertElliott
        from ge_threshold.policies import ChannelThreshold
    finally:
        sys.path.remove(str(EXAMPLE_PLUGINS))
    for where, cls in (("policy_params.channel-threshold", ChannelThreshold),
                       ("channel.state.params (source gilbert-elliott)", GilbertElliott)):
        params = declared_params(cls)
        rows = []
        if isinstance(params, dict):
            rows = [(k, type_text(type(v)), "", default_text_of(v), "(a dict `Params`: its defaults only; the "
                     "plug-in's docstring says what each means)") for k, v in params.items()]
        else:
            rows = model_rows(params)[0]
        out += [f"`{where}` ({cls.__module__}:{cls.__name__}):", ""] + table(rows) + [""]
    return out


def default_text_of(value) -> str:
    return f"{value:g}" if isinstance(value, float) else f"`{value}`"


def reference_markdown() -> str:
    """The whole reference, deterministic: the same schema gives the same text."""
    from testbed.channel.config import ChannelStateSettings
    from testbed.core.scenario import Device, DropSpec, Scenario
    from testbed.run.profile import Profile

    out = [INTRO]
    out += _model_sections("Run profile (top level)", Profile, "", "The keys of a run profile's top level; the "
                           "sections follow. `scenario:` and `channel.state` have sections of their own below.")
    out += _model_sections("`scenario`", Scenario, "scenario.", "The system model's parameters "
                           "([system-model.md](system-model.md)); a scenario file (`profiles/scenarios/`) has these "
                           "keys at its top level.", skip=("drop", "devices"))
    out += _model_sections("`scenario.devices[]`", Device, "scenario.devices[].")
    out += _model_sections("`scenario.drop`", DropSpec, "scenario.drop.")
    out += _model_sections("`channel.state` (built-in sources)", ChannelStateSettings, "channel.state.",
                           "The channel's state per round ([channel.md](channel.md)); a plug-in source's keys are "
                           "its own (`channel.state.params`, below).")
    out += plugin_sections()
    return "\n".join(out).rstrip("\n") + "\n"
