"""Finding users' policies and channel sources: by Python path or by installed entry point.

A policy is named in a profile (``policy: NAME``) or on the command line (``--policy``, ``--policies``) by

- a built-in name (`testbed.core.optimizer.POLICIES`),
- ``module:attribute`` (``mypkg.policies:MyPolicy``): imported from the Python path, or
- the name of an entry point in the ``multispin.policies`` group of an installed package.

A channel source (``channel.state.source``) likewise: a built-in name (`testbed.channel.state.SOURCES`),
``module:Class``, or an entry point of ``multispin.channels``. The attribute may be a class (constructed
without arguments for a policy, or with its parameters as keywords; with ``(cfg, devices)`` for a channel
source), a factory, or (a policy) an object with ``decide``. Every failure is a `PluginError` that says which
name, what was tried and why.

Parameters: a plug-in declares them as a class attribute ``Params``, a dict of defaults or a pydantic model
(`declared_params`); the profile gives them (``policy_params: {NAME: {...}}``, ``channel.state.params``),
`resolve_params` checks them (an unknown name is an error naming the plug-in and the parameter) and fills in
the defaults. A plug-in that raises while a run plans is a `PluginFailure` (the run stops with exit status
3, unless the profile says ``on_plugin_error: fallback``).
Interfaces: `testbed.core.policy.Policy`, `testbed.channel.source.ChannelSource`; docs/extending.md.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from testbed.runtime.errors import TestbedError

POLICY_GROUP = "multispin.policies"
CHANNEL_GROUP = "multispin.channels"


class PluginError(TestbedError, ValueError):
    """A plug-in that cannot be used: not importable, not found, or not satisfying its interface."""


# The exit status of `multispin run` (and rerun, edge) when a plug-in raised during the run (docs/commands.md).
PLUGIN_FAILURE_EXIT = 3


class PluginFailure(TestbedError):
    """A plug-in raised (or answered unusably) while a run planned a round, and the profile says
    ``on_plugin_error: stop`` (the default): the run stops, `multispin run` exits with `PLUGIN_FAILURE_EXIT`.
    `kind`: "policy" or "channel source"; `name`: the plug-in's name; `round`; `error`: the exception's
    type and message; `traceback`: the formatted traceback (logged, and written to the run's logs/)."""

    exit_status = PLUGIN_FAILURE_EXIT

    def __init__(self, kind: str, name: str, round_index: int, error: str, traceback: str = ""):
        self.kind, self.name, self.round, self.error, self.traceback = kind, name, int(round_index), error, traceback
        super().__init__(f"{kind} {name!r} failed in round {round_index}: {error} (on_plugin_error: stop; "
                         f"`on_plugin_error: fallback` in the profile goes on without it)")

    def as_dict(self) -> dict:
        """The failure as meta.json and summary.json keep it (`plugin_failure`)."""
        return {"kind": self.kind, "name": self.name, "round": self.round, "error": self.error}


# -- parameters ---------------------------------------------------------------------------------------

def declared_params(target: Any) -> Any:
    """What a plug-in (its class, factory or object) declares as ``Params``: a dict of defaults, a pydantic
    model class, or None (it takes no parameters)."""
    params = getattr(target, "Params", None)
    if params is None:
        return None
    if isinstance(params, dict) or _is_model(params):
        return params
    raise PluginError(f"{getattr(target, '__name__', type(target).__name__)}.Params is {type(params).__name__}: "
                      "declare a plug-in's parameters as a dict of defaults or a pydantic model")


def _is_model(obj: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(obj, type) and issubclass(obj, BaseModel)


def resolve_params(what: str, spec: str, target: Any, given: dict | None) -> dict | None:
    """The parameters a plug-in gets: its declared defaults updated with `given` (the profile's), checked.
    None when it declares none and none are given. A PluginError names the plug-in and the parameter."""
    declared = declared_params(target)
    if given is not None and not isinstance(given, dict):
        raise PluginError(f"{what} {spec!r}: parameters must be a mapping name -> value, not "
                          f"{type(given).__name__}")
    given = dict(given or {})
    if declared is None:
        if given:
            raise PluginError(f"{what} {spec!r} takes no parameters (it declares no Params); given: "
                              f"{', '.join(sorted(map(str, given)))}")
        return None
    names = list(declared) if isinstance(declared, dict) else list(declared.model_fields)
    unknown = [k for k in given if k not in names]
    if unknown:
        from testbed.runtime.errors import did_you_mean

        raise PluginError(f"{what} {spec!r}: unknown parameter {unknown[0]!r}{did_you_mean(unknown[0], names)} "
                          f"(its parameters: {', '.join(names) or 'none'})")
    if isinstance(declared, dict):
        return {**declared, **given}
    from pydantic import ValidationError

    try:
        return declared.model_validate(given).model_dump()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "?"
        raise PluginError(f"{what} {spec!r}: parameter {where}: {err.get('msg')} (given: "
                          f"{err.get('input')!r})") from None


# -- importing ----------------------------------------------------------------------------------------

def import_object(spec: str, what: str) -> Any:
    """The object that ``module:attribute`` (dotted attributes allowed) names; `what` ("policy", ...) heads
    the error."""
    module, sep, attr = spec.partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise PluginError(f"{what} {spec!r}: a Python path is module:attribute, e.g. mypkg.policies:MyPolicy")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise PluginError(f"{what} {spec!r}: no module named {exc.name!r} (is its package installed, e.g. "
                              f"`pip install -e DIR`, or its folder on PYTHONPATH?)") from None
        raise PluginError(f"{what} {spec!r}: importing {module} failed: {exc}") from exc
    except Exception as exc:  # the plug-in's own import-time error, shown as it is
        raise PluginError(f"{what} {spec!r}: importing {module} failed: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in dir(obj) if not n.startswith("_"))
            from testbed.runtime.errors import did_you_mean

            raise PluginError(f"{what} {spec!r}: {module} has no attribute {attr!r}"
                              f"{did_you_mean(part, names)}") from None
    return obj


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of `group` by name (the first one found wins a repeated name)."""
    out: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        out.setdefault(ep.name, ep)
    return out


def _target(spec: str, what: str, group: str, builtins) -> Any:
    """The object a non-built-in name stands for: a Python path, else an entry point of `group`."""
    if ":" in spec:
        return import_object(spec, what)
    eps = entry_points(group)
    if spec not in eps:
        from testbed.runtime.errors import did_you_mean

        known = list(builtins) + sorted(eps)
        installed = f"; installed ({group}): {', '.join(sorted(eps))}" if eps else f"; none installed ({group})"
        raise PluginError(f"unknown {what} {spec!r}{did_you_mean(spec, known)} (built in: {', '.join(builtins)}"
                          f"{installed}; or a Python path module:Class)")
    try:
        return eps[spec].load()
    except Exception as exc:
        raise PluginError(f"{what} {spec!r} (entry point {eps[spec].value} of {group}): loading failed: "
                          f"{type(exc).__name__}: {exc}") from exc


def _takes(fn, n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments."""
    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call decide
        return True
    return True


# -- policies -----------------------------------------------------------------------------------------

@dataclass
class NamedPolicy:
    """A plug-in policy under the name the user gave it (the spec), which labels plans, rows and records."""

    name: str
    policy: Any
    params: dict | None = None  # the parameters it was built with (declared defaults + the profile's)

    @property
    def description(self) -> str:
        text = getattr(self.policy, "description", None) or inspect.getdoc(type(self.policy)) or ""
        return str(text).strip().splitlines()[0] if str(text).strip() else ""

    def decide(self, scenario, context):
        return self.policy.decide(scenario, context)


def load_policy(spec: str, params: dict | None = None):
    """A policy object for a name: `BuiltinPolicy` for a built-in name, else the plug-in (a `NamedPolicy`
    under `spec`). A plug-in class or factory that declares ``Params`` is called with its parameters as
    keywords (the defaults, updated with `params`: the profile's ``policy_params[spec]``). A PluginError says
    what failed: the import, the lookup, a parameter or the interface."""
    from testbed.core.optimizer import POLICIES, BuiltinPolicy

    spec = str(spec).strip()
    if spec in POLICIES:
        if params:
            raise PluginError(f"policy {spec!r} is built in and takes no parameters (policy_params.{spec})")
        return BuiltinPolicy(spec)
    target = _target(spec, "policy", POLICY_GROUP, POLICIES)
    obj = target
    resolved = resolve_params("policy", spec, target, params)
    if not callable(getattr(obj, "decide", None)) or isinstance(obj, type):
        if not callable(obj):
            raise PluginError(f"policy {spec!r}: {type(obj).__name__} object is neither a policy (no decide method) "
                              "nor a class or factory that makes one")
        try:
            obj = obj(**(resolved or {}))
        except Exception as exc:
            how = "with its parameters" if resolved is not None else "without arguments (or declare Params)"
            raise PluginError(f"policy {spec!r}: {getattr(target, '__name__', target)}() failed: "
                              f"{type(exc).__name__}: {exc} (a policy class is constructed {how})") from exc
    elif resolved:
        raise PluginError(f"policy {spec!r}: an object, not a class or factory: it cannot take parameters")
    decide = getattr(obj, "decide", None)
    if not callable(decide):
        raise PluginError(f"policy {spec!r}: {type(obj).__name__} does not satisfy the Policy interface: it has no "
                          "method decide(scenario, context) -> Decision")
    if not _takes(decide, 2):
        raise PluginError(f"policy {spec!r}: {type(obj).__name__}.decide{inspect.signature(decide)} does not take "
                          "(scenario, context), the Policy interface")
    return NamedPolicy(spec, obj, resolved)


def check_policy(spec: str, unknown: str = "unknown policy") -> None:
    """Raise a PluginError unless `load_policy(spec)` works: an unknown name gets `unknown`, a did-you-mean and
    the names there are; a plug-in is loaded (imported and checked against the interface)."""
    from testbed.core.optimizer import POLICIES
    from testbed.runtime.errors import did_you_mean

    if spec in POLICIES:
        return
    names = policy_names()
    if ":" not in str(spec) and spec not in names:
        raise PluginError(f"{unknown}{did_you_mean(spec, names)} (allowed: {', '.join(names)}; or a plug-in's "
                          "Python path module:Class)")
    load_policy(spec)


def policy_names() -> list[str]:
    """Every policy a name can pick: the built-in ones, then the installed entry points."""
    from testbed.core.optimizer import POLICIES

    return list(POLICIES) + [n for n in sorted(entry_points(POLICY_GROUP)) if n not in POLICIES]


# -- channel sources ----------------------------------------------------------------------------------

def load_channel_source(spec: str):
    """The class (or factory) of a plug-in channel source, checked as far as it can be before it is built
    with ``(cfg, devices)``; `testbed.channel.state.ChannelState.from_config` takes it as `resolve`."""
    from testbed.channel.state import SOURCES

    spec = str(spec).strip()
    if spec in SOURCES:
        raise PluginError(f"channel source {spec!r} is built in; it is not loaded as a plug-in")
    target = _target(spec, "channel source", CHANNEL_GROUP, SOURCES)
    if not callable(target):
        raise PluginError(f"channel source {spec!r}: {type(target).__name__} object is not a class or factory")
    if isinstance(target, type) and not callable(getattr(target, "link_states", None)):
        raise PluginError(f"channel source {spec!r}: {target.__name__} does not satisfy the ChannelSource "
                          "interface: it has no method link_states(round_index, t_s)")
    if not _takes(target, 2):
        raise PluginError(f"channel source {spec!r}: {getattr(target, '__name__', target)} cannot be built "
                          "with (cfg, devices), the ChannelSource constructor")
    return target


def channel_source_params(cfg: dict | None) -> dict | None:
    """A plug-in source's parameters: ``channel.state.params`` checked against the source's ``Params``, the
    defaults filled in (None for a built-in source or one without Params and no params). A PluginError names
    the source and the parameter."""
    from testbed.channel.state import SOURCES

    cfg = cfg or {}
    source = cfg.get("source", "model")
    if not isinstance(source, str) or source in SOURCES:
        return None
    return resolve_params("channel source", source, load_channel_source(source), cfg.get("params"))


def channel_state_from_config(cfg: dict, devices: list[dict], scenario=None):
    """`ChannelState.from_config` with plug-in sources allowed. With `scenario`, the state turns SNRs into
    gains with the scenario's noise (`noise_psd_dbm_hz`, `noise_figure_db`) and each device's maximum power
    and UL bandwidth, unless `cfg` names its own (noise, `snr_reference`), so that the model predicts the
    SNR a trace or a live reading gave."""
    from testbed.channel.state import ChannelState

    params = channel_source_params(cfg)
    if params is not None:  # the source reads cfg["params"]: its declared defaults, updated with the profile's
        cfg = {**cfg, "params": params}
    if scenario is not None:
        cfg = {"noise_psd_dbm_hz": scenario.noise_psd_dbm_hz, "noise_figure_db": scenario.noise_figure_db, **cfg}
        if "snr_reference" not in cfg:
            own = {d.name: (d.max_power_w, b) for d, b in zip(scenario.devices, scenario.ul_bandwidths_hz())}
            devices = [{"max_power_w": own[d["name"]][0], "uplink_bandwidth_hz": float(own[d["name"]][1]), **d}
                       if d.get("name") in own else d for d in devices]
    return ChannelState.from_config(cfg, devices, resolve=load_channel_source)


@dataclass
class ChannelGains:
    """`multispin simulate --channel`: per drop, the gains of a channel state built from `cfg` (a profile's
    ``channel.state``) for the drop's devices, seeded with ``seed + drop``; picklable, for the workers."""

    cfg: dict
    seed: int = 0

    def __call__(self, scenario, drop: int):
        devices = [d.model_dump(exclude_none=True) for d in scenario.devices]
        state = channel_state_from_config({**self.cfg, "seed": int(self.cfg.get("seed", self.seed)) + drop}, devices,
                                          scenario)
        return _NamedGains(state)


@dataclass
class _NamedGains:
    """A channel state's `gains_db` whose source's failure (`ChannelSourceError`: it names the source and
    the round) is a PluginError: one line, not a traceback, in `simulate --monte-carlo --channel`."""

    state: Any

    def __call__(self, round_index: int, t_s: float):
        from testbed.channel.state import ChannelSourceError

        try:
            return self.state.gains_db(round_index, t_s)
        except ChannelSourceError as exc:
            raise PluginError(str(exc)) from exc


# -- listing ------------------------------------------------------------------------------------------

def installed() -> dict[str, list[dict]]:
    """What `multispin plugins` shows: per kind, the built-in names and the installed entry points, each
    with its target, its distribution and whether it loads and satisfies its interface."""
    from testbed.channel.state import SOURCES
    from testbed.core.optimizer import POLICIES

    out: dict[str, list[dict]] = {"policies": [], "channels": []}
    for name, text in POLICIES.items():
        out["policies"].append({"name": name, "origin": "built in", "description": text, "ok": True})
    for name, text in SOURCES.items():
        out["channels"].append({"name": name, "origin": "built in", "description": text, "ok": True})
    for kind, group, builtins, load in (("policies", POLICY_GROUP, POLICIES, load_policy),
                                        ("channels", CHANNEL_GROUP, SOURCES, load_channel_source)):
        for name, ep in sorted(entry_points(group).items()):
            dist = getattr(ep, "dist", None)
            row = {"name": name, "origin": f"{group} entry point", "target": ep.value,
                   "distribution": f"{dist.name} {dist.version}" if dist is not None else None}
            if name in builtins:
                row.update(ok=False, error=f"shadowed by the built-in {name!r}: rename the entry point")
            else:
                try:
                    obj = load(name)
                except PluginError as exc:
                    row.update(ok=False, error=str(exc))
                else:
                    doc = getattr(obj, "description", None) or inspect.getdoc(obj) or ""
                    row.update(ok=True, description=str(doc).strip().splitlines()[0] if str(doc).strip() else "")
            out[kind].append(row)
    return out
