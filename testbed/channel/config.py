"""The schema of a profile's ``channel.state`` mapping: every key the built-in sources read, typed, bounded.

`check_state(cfg)` validates a mapping before anything is built from it (the profile does it at load, so
that ``multispin run``, ``plan``, ``compare`` and ``campaign`` refuse a bad key or value before a process
starts): an unknown key is named with the nearest valid one, a value with what is allowed. A plug-in source
(``source`` not one of `testbed.channel.state.SOURCES`) reads its own keys: only ``source`` is checked then.
The keys, their defaults and meaning are those of `testbed.channel.state` (``from_config`` and the source
classes) and `testbed.channel.traces` (a trace entry); the tables in docs/real-links.md list them.

pydantic, as the profile and the scenario use it: one library for all validation, whose errors carry the
key's location, the offending value and the rule.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from testbed.channel.state import FADING, LIVE_FALLBACK, MOBILITY, SOURCES, TRACE_INDEX
from testbed.channel.traces import ENTRY_KEYS, FORMATS
from testbed.core.scenario import Scenario

# The path-loss laws of `testbed.core.radio.path_loss_db`, as the scenario lists them.
PathLossLaw = Scenario.model_fields["path_loss_law"].annotation
DEFAULT_CELL_RADIUS_M = 500.0


class ChannelConfigError(ValueError):
    """A ``channel.state`` mapping that does not validate. `problems`: (location below ``channel.state``,
    one-line message) per problem; str(): the messages, one a line."""

    def __init__(self, problems: list[tuple[tuple, str]]):
        self.problems = problems
        super().__init__("\n".join(line for _, line in problems))


def _shown(text: str) -> dict:
    """The default as the keys table (docs/real-links.md) shows it, where the schema's is a placeholder."""
    return {"shown_default": text}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MobilitySettings(_Strict):
    """``mobility``: the distance of each device over time (`testbed.channel.state.Mobility`)."""

    kind: Literal[MOBILITY] = Field(default="none", description="none, linear (radial, bouncing) or "
                                                                "random_waypoint")
    speed_mps: float = Field(default=1.0, ge=0, description="m/s")
    min_distance_m: float = Field(default=10.0, gt=0, description="the inner edge of the cell, m")
    cell_radius_m: float | None = Field(default=None, gt=0, description="m",
                                       json_schema_extra=_shown("channel.state.cell_radius_m, else 500"))


class SnrReference(_Strict):
    """``snr_reference``: the power and bandwidth an SNR refers to, for a device without its own."""

    power_dbm: float = Field(default=23.0, description="dBm")
    bandwidth_hz: float = Field(default=1e6, gt=0, description="Hz")


class LiveSettings(_Strict):
    """``live``: the staleness rule of ``source: live``."""

    max_age_s: float | None = Field(default=None, gt=0, description="s; null: a reading never goes stale")
    fallback: Literal[LIVE_FALLBACK] = Field(default="model", description="for a device without a fresh reading")


class TraceEntry(_Strict):
    """One trace of a device and role (`testbed.channel.traces.load_entry`); a bare string is its path."""

    path: str = Field(min_length=1, description="the file (absolute, else under trace.base_dir, the working "
                                                "folder, then the shipped profiles folder)")
    format: Literal[FORMATS] | None = Field(default=None, description="guessed from the file when left out")
    column: str | None = Field(default=None, description="ucc, lumos5g: the column (default per role)")
    bin_s: float = Field(default=0.1, gt=0, description="mahimahi: the bin, s")
    state: str = Field(default="D", description="ucc: rows of this State only (rates), 'any' for every row")
    run: int | None = Field(default=None, description="lumos5g: run_num (default: the first)")
    mobility_mode: str | None = Field(default=None, description="lumos5g: filter, e.g. walking, driving")
    trajectory_direction: str | None = Field(default=None, description="lumos5g: filter, CW or ACW")
    device: str | None = Field(default=None, description="snr_csv: whose rows (default: the device's own)")
    scale: float = Field(default=1.0, gt=0, description="a factor on a rate trace")


class DeviceTraces(_Strict):
    """``trace.devices.<name or '*'>``: a device's traces by role."""

    snr: TraceEntry | None = Field(default=None, description="an SNR trace: gives the gain")
    ul: TraceEntry | None = Field(default=None, description="a UL rate trace: fixes the UL rate")
    dl: TraceEntry | None = Field(default=None, description="a DL rate trace: fixes the DL rate")

    @field_validator("snr", "ul", "dl", mode="before")
    @classmethod
    def _path_alone(cls, value):
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _scale_on_rates(self):
        if self.snr is not None and self.snr.scale != 1.0:
            raise ValueError("snr.scale: a scale applies to a rate trace (ul, dl) only")
        return self


class TraceSettings(_Strict):
    """``trace``: replayed files (`testbed.channel.state.TraceSource`)."""

    path: str | None = Field(default=None, min_length=1, description="one time_s,device,snr_db CSV for every device")
    index: Literal[TRACE_INDEX] = Field(default="time", description="time: the sample at or before the round's "
                                                                    "wall time; round: the round-th sample")
    loop: StrictBool | None = Field(default=None, description="wrap at the end (true) or hold the last value "
                                                              "(false); null: Mahimahi wraps, others hold")
    devices: dict[str, DeviceTraces | None] | None = Field(default=None, description="device name (or '*') -> "
                                                                                      "{snr, ul, dl}")
    base_dir: str | None = Field(default=None, description="where relative trace paths are looked up first")
    min_rate_bps: float = Field(default=1e4, gt=0, description="the floor of a replayed rate, bit/s")


class ChannelStateSettings(_Strict):
    """``channel.state`` of a built-in source."""

    source: Literal[tuple(SOURCES)] = Field(default="model", description="model, trace or live (else a plug-in)")
    seed: int = Field(default=0, ge=0, description="the channel's draws", json_schema_extra=_shown("the run's seed"))
    path_loss_law: PathLossLaw = Field(default="3gpp_macro", description="model (and the distance fallback)")
    shadowing_sigma_db: float = Field(default=0.0, ge=0, description="log-normal shadowing, dB, one draw per "
                                                                     "device")
    fading: Literal[FADING] = Field(default="rayleigh", description="Rayleigh block fading, redrawn per round")
    mobility: MobilitySettings | None = Field(default=None, description="{kind, speed_mps, min_distance_m, "
                                                                        "cell_radius_m}")
    cell_radius_m: float | None = Field(default=None, gt=0, description="mobility's cell radius, m",
                                       json_schema_extra=_shown(f"{DEFAULT_CELL_RADIUS_M:g}"))
    noise_psd_dbm_hz: float | None = Field(default=None, description="N_0 before the noise figure, dBm/Hz",
                                           json_schema_extra=_shown("the scenario's (-174 without one)"))
    noise_figure_db: float | None = Field(default=None, ge=0, description="dB",
                                          json_schema_extra=_shown("the scenario's (0 without one)"))
    snr_reference: SnrReference | None = Field(default=None, description="{power_dbm, bandwidth_hz} of an SNR, "
                                                                         "for a device without its own")
    live: LiveSettings | None = Field(default=None, description="source live: {max_age_s, fallback}")
    trace: TraceSettings | None = Field(default=None, description="source trace: {path, devices, index, loop, "
                                                                  "base_dir, min_rate_bps}")

    @model_validator(mode="after")
    def _cross(self):
        mob = self.mobility or MobilitySettings()
        radius = mob.cell_radius_m or self.cell_radius_m or DEFAULT_CELL_RADIUS_M
        if not mob.min_distance_m < radius:
            raise ValueError(f"mobility: min_distance_m {mob.min_distance_m:g} is not allowed; must be < the cell "
                             f"radius {radius:g} m (mobility.cell_radius_m, else channel.state.cell_radius_m, "
                             f"else {DEFAULT_CELL_RADIUS_M:g})")
        if self.source == "trace" and (self.trace is None or (self.trace.path is None and not self.trace.devices)):
            raise ValueError("source trace needs trace.path (a time_s,device,snr_db CSV) or trace.devices "
                             "(per device ul / dl / snr traces)")
        return self


# -- errors in the CLI's words -----------------------------------------------------------------------

def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema model at a location below channel.state (None where it is not a model)."""
    node: Any = ChannelStateSettings
    for part in loc:
        if node == "dict":  # trace.devices: the key is a device name
            node = DeviceTraces
        elif isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = _inner(node.model_fields[part].annotation)
        else:
            return None
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def _inner(annotation) -> Any:
    """The model inside an annotation (``X | None``); 'dict' for the devices mapping."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return "dict"
    for arg in typing.get_args(annotation):
        node = _inner(arg)
        if node is not None:
            return node
    return None


def _where(prefix: str, loc: tuple) -> str:
    return ".".join([prefix, *(str(p) for p in loc)]) if prefix else ".".join(str(p) for p in loc)


def _hint(word: str, names: list[str]) -> str:
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f" (keys: {', '.join(names)})"


def _allowed(err: dict) -> str:
    expected = str((err.get("ctx") or {}).get("expected", ""))
    return ", ".join(c.strip().strip("'\"") for c in expected.replace(" or ", ",").split(",") if c.strip())


def _line(err: dict, prefix: str) -> tuple[tuple, str]:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    t, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if t == "extra_forbidden":
        model = _model_at(loc[:-1])
        names = list(model.model_fields) if model is not None else sorted(ENTRY_KEYS)
        return loc, f"unknown key {loc[-1]!r} in {_where(prefix, loc[:-1])}{_hint(loc[-1], names)}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if t == "literal_error":
        why = f"allowed: {_allowed(err)}"
    elif t in bounds:
        bound = next(iter(ctx.values()))
        why = f"must be {bounds[t]} {bound:g}" if isinstance(bound, (int, float)) else f"must be {bounds[t]} {bound}"
    elif t == "missing":
        return loc, f"{_where(prefix, loc)}: required key is missing"
    elif t == "value_error":
        msg = str(ctx.get("error") or err["msg"]).removeprefix("Value error, ")
        # A cross-key rule names its key itself: 'mobility.min_distance_m: 5 is not allowed; ...'
        key, sep, rest = msg.partition(": ")
        sub = tuple(key.split(".")) if sep and " " not in key else ()
        return loc + sub, f"{_where(prefix, loc + sub)}: {rest if sub else msg}"
    else:
        why = err["msg"].replace("Input should be", "must be")
    shown = "a mapping" if isinstance(value, Mapping) else repr(value)
    return loc, f"{_where(prefix, loc)}: {shown} is not allowed; {why}"


def check_state(cfg: Any, prefix: str = "channel.state") -> ChannelStateSettings | None:
    """The validated settings of a ``channel.state`` mapping (None for a plug-in source, whose keys are its
    own; None given: None). Raises `ChannelConfigError`, one line per problem naming the key under
    `prefix` and the value."""
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise ChannelConfigError([((), f"{prefix}: {cfg!r} is not allowed; must be a mapping of keys "
                                       f"(e.g. {{source: model, fading: rayleigh}})")])
    source = cfg.get("source", "model")
    if not isinstance(source, str) or not source.strip():
        raise ChannelConfigError([(("source",), f"{_where(prefix, ('source',))}: {source!r} is not allowed; must be "
                                                f"the name of a source: built in ({', '.join(SOURCES)}), or a "
                                                "plug-in's module:Class or entry point name")])
    if source not in SOURCES:
        return None  # a plug-in's keys are its own (testbed.runtime.plugins loads and checks it)
    try:
        return ChannelStateSettings.model_validate(dict(cfg))
    except ValidationError as exc:
        raise ChannelConfigError([_line(err, prefix) for err in exc.errors()]) from None


def keys_table() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) per key of the schema, nested keys dotted; a trace entry's keys once,
    under ``trace.devices.<device>.<role>`` (docs/real-links.md shows this table)."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            inner, key = _inner(f.annotation), prefix + name
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            default = extra.get("shown_default") or ("required" if f.is_required() else "null" if f.default is None
                                                     else f"{f.default:g}" if isinstance(f.default, float)
                                                     else str(f.default))
            if inner == "dict":
                rows.append((key, "mapping: device name or '*' -> {snr, ul, dl}", default, f.description or ""))
                walk(DeviceTraces, key + ".<device>.")
            elif inner is TraceEntry:
                rows.append((key, "a path, or a trace entry (keys below)", default, f.description or ""))
            elif inner is not None:
                walk(inner, key + ".")
            else:
                rows.append((key, _type_text(f.annotation), default, f.description or ""))

    walk(ChannelStateSettings, "")
    walk(TraceEntry, "trace.devices.<device>.<role>.")
    return rows


def keys_markdown() -> str:
    """`keys_table` as a markdown table."""
    lines = ["| key | type or allowed values | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, meaning in keys_table():
        cells = (f"`{key}`", kind, default, meaning)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _type_text(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # StrictBool
        return _type_text(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if args:
        parts = [_type_text(a) for a in args if a is not type(None)]
        return " | ".join(parts) + (" | null" if type(None) in args else "")
    return {"float": "number", "int": "integer", "str": "string", "bool": "true | false"}.get(
        getattr(annotation, "__name__", str(annotation)), str(annotation))
