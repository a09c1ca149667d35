"""The scenario schema: everything the system model (spec sections 1-9) needs, with the spec's units.

A scenario is loaded from YAML or a dict; a wrong field raises `ScenarioError` whose lines name the
field, the value and what is allowed, e.g. ``devices[1].acceptance: 1.3 is not allowed: must be in (0, 1)``.
Every **Option** of the spec is a field with the spec's default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from testbed.core import radio


class ScenarioError(ValueError):
    """A scenario that does not validate; the message has one readable line per problem."""


class _Strict(BaseModel):
    # No infinities or NaN: `uplink_bandwidth_hz: .inf` would pass `gt=0` and give infinite rates.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Device(_Strict):
    """One device: its channel (a gain in dB or a distance in m), radio, SLM speed and acceptance."""

    name: str = Field(min_length=1, description="the device's name (unique; the key of hardware:, link_probe:, --set)")
    channel_gain_db: float | None = Field(default=None, description="g_k in dB (negative); or distance_m")
    distance_m: float | None = Field(default=None, gt=0, description="distance to the edge, m")
    max_power_w: float = Field(default=0.2, gt=0, description="P^max_k, W (23 dBm = 0.2 W)")
    draft_time_s: float = Field(gt=0, description="t_k, s per drafted token")
    acceptance: float = Field(gt=0, lt=1, description="alpha_k, per-token acceptance rate")
    uplink_bandwidth_hz: float | None = Field(default=None, gt=0, description="B^U_k override, Hz")
    energy_budget_j: float | None = Field(default=None, gt=0, description="per-round UL energy E_k, J")
    # A link whose rate is given, not modeled (a rate trace, a link the edge measured): the rate does not
    # follow the power, so the plan sends at P^max there and no energy budget lowers it.
    fixed_ul_rate_bps: float | None = Field(default=None, gt=0, description="a fixed UL rate, bit/s")
    fixed_dl_rate_bps: float | None = Field(default=None, gt=0, description="a fixed DL rate, bit/s")

    @model_validator(mode="after")
    def _one_channel(self):
        if (self.channel_gain_db is None) == (self.distance_m is None):
            raise ValueError("give exactly one of channel_gain_db or distance_m")
        if self.channel_gain_db is not None and not (-250.0 < self.channel_gain_db < 0.0):
            raise ValueError(f"channel_gain_db {self.channel_gain_db} must be in (-250, 0) dB")
        return self


class DropSpec(_Strict):
    """How the offline simulator draws random devices (spec section 5 defaults)."""

    num_devices: int = Field(default=10, ge=1, description="devices drawn per drop")
    distance_m: tuple[float, float] = Field(default=(50.0, 500.0), description="[low, high] m, uniform")
    draft_time_s: tuple[float, float] = Field(default=(0.015, 0.060), description="[low, high] s per token, "
                                                                                  "uniform")
    acceptance: tuple[float, float] = Field(default=(0.6, 0.85), description="[low, high], uniform")
    max_power_w: float = Field(default=0.2, gt=0, description="every drawn device's P^max, W")

    @field_validator("distance_m", "draft_time_s", "acceptance")
    @classmethod
    def _range(cls, v):
        lo, hi = v
        if not (0 < lo <= hi):
            raise ValueError(f"must be a range [low, high] with 0 < low <= high, got {list(v)}")
        return v

    @field_validator("acceptance")
    @classmethod
    def _acc(cls, v):
        if v[1] >= 1:
            raise ValueError(f"acceptance range must lie in (0, 1), got {list(v)}")
        return v


class Scenario(_Strict):
    """A whole scenario: global radio/compute parameters, the Options, and the devices."""

    vocab_size: int = Field(default=151936, ge=2, description="V, entries of a transmitted distribution")
    bits_per_prob: int = Field(default=16, ge=1, le=64, description="b_p, bits per probability")
    max_draft_len: int = Field(default=12, ge=1, le=64, description="L_max")
    noise_psd_dbm_hz: float = Field(default=-174.0, description="N_0 before the noise figure, dBm/Hz")
    noise_figure_db: float = Field(default=9.0, ge=0, description="receiver noise figure, dB")
    uplink_bandwidth_hz: float = Field(default=1.0e6, gt=0, description="B^U per device, Hz")
    downlink_bandwidth_hz: float = Field(default=2.0e7, gt=0, description="B^D shared, Hz")
    downlink_power_w: float = Field(default=10.0, gt=0, description="P_s, W (40 dBm = 10 W)")
    verify_t0_s: float = Field(default=0.02, ge=0, description="t_0 of T_ver, s")
    verify_t1_s: float = Field(default=1.0e-4, ge=0, description="t_1 of T_ver, s per verified position")
    round_overhead_s: float = Field(default=0.0, ge=0, description="T_0, fixed per-round overhead, s")
    ul_reply_s: float = Field(default=1.0e-3, ge=0, description="time charged per small reply message, s")
    # Protocol header carried by every draft upload and DL-mode verdict (0 in the spec; the live
    # controller measures it from the bytes the channel charged).
    header_bits: float = Field(default=0.0, ge=0, description="header bits added to each message")
    path_loss_law: Literal["3gpp_macro", "free_space_2ghz"] = Field("3gpp_macro", description="gain from distance")
    # Options (spec sections 3-5), defaults first in each list.
    ul_protocol: Literal["eager", "lazy"] = Field("eager", description="UL-mode upload (system-model.md, section 3)")
    dl_protocol: Literal["rejected_only", "all_positions"] = Field("rejected_only",
                                                                  description="DL-mode payloads (section 3)")
    dl_provisioning: Literal["worst_case", "expected", "realized"] = Field(
        "worst_case", description="what the plan reserves on the DL (section 3)")
    payload_format: Literal["dense", "topk"] = Field("dense", description="draft distributions: whole, or top-k "
                                                                          "(topk_k entries)")
    topk_k: int = Field(default=1024, ge=1, description="entries kept per distribution when topk")
    # Top-k chosen by the plan (testbed.core.payload): each round it keeps the best of dense and these k
    # (one draft distribution for every device of the round); () = off: payload_format and topk_k hold.
    topk_choices: tuple[int, ...] = Field(default=(), description="k values the plan may choose each round")
    # alpha under top-k k = ratio x acceptance (clipped into (0, 1)); a k without an entry: 1 (no loss). A
    # live run calibrates the ratios on its pair (estimator.calibrate; this is then unused) and learns alpha
    # per (device, k).
    topk_acceptance_ratio: dict[int, float] = Field(default_factory=dict, description="alpha_k / alpha per k")
    verify_batch: Literal["ragged", "padded"] = Field("ragged", description="T_ver of a batch (section 5)")
    dl_access: Literal["fdma_equal_split", "fdma_fixed_split", "tdma"] = Field(
        "fdma_equal_split", description="how DL-mode devices share the downlink (section 4)")
    rounds: Literal["synchronous", "asynchronous"] = Field("synchronous", description="one round for all, or each "
                                                                                    "device on its own (sections 5, 6)")
    # The uplink (docs/system-model.md, section 4): a dedicated band per device (uplink_bandwidth_hz each), or
    # one band of uplink_total_bandwidth_hz (default: N x uplink_bandwidth_hz, the same spectrum) that the
    # plan divides among the devices every round, each getting at least ul_min_share x B / N.
    ul_access: Literal["dedicated", "fdma_shared"] = Field("dedicated", description="a band per device, or one "
                                                                                   "shared band the plan splits")
    uplink_total_bandwidth_hz: float | None = Field(default=None, gt=0, description="B^U shared (fdma_shared), Hz")
    ul_min_share: float = Field(default=0.05, gt=0, le=1, description="least share of B^U / N per device")
    drop: DropSpec | None = Field(default=None, description="random-drop settings for `simulate`")
    devices: list[Device] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self):
        counts = Counter(d.name for d in self.devices)  # list.count per name was N^2: 1 ms at 256 devices
        dup = sorted(n for n, c in counts.items() if c > 1)
        if dup:
            raise ValueError(f"device names must be unique; repeated: {', '.join(dup)}")
        return self

    @model_validator(mode="after")
    def _shared_uplink(self):
        if self.ul_access == "dedicated":
            if self.uplink_total_bandwidth_hz is not None:
                raise ValueError(f"uplink_total_bandwidth_hz: {self.uplink_total_bandwidth_hz} is not allowed with "
                                 "ul_access 'dedicated' (each device has uplink_bandwidth_hz); set ul_access: "
                                 "fdma_shared, or leave it out")
            return self
        # Not implemented on a shared band: the split would have to follow a power that an energy budget
        # lowers, and the lazy second upload would need a split of its own.
        if self.ul_protocol == "lazy":
            raise ValueError("ul_protocol: 'lazy' is not allowed with ul_access 'fdma_shared' (not implemented)")
        named = [d.name for d in self.devices if d.uplink_bandwidth_hz is not None]
        if named:
            raise ValueError(f"devices' uplink_bandwidth_hz ({', '.join(named[:3])}) is not allowed with ul_access "
                             "'fdma_shared': the plan divides uplink_total_bandwidth_hz")
        budget = [d.name for d in self.devices if d.energy_budget_j is not None]
        if budget:
            raise ValueError(f"energy_budget_j ({', '.join(budget[:3])}) is not allowed with ul_access "
                             "'fdma_shared' (not implemented)")
        return self

    @model_validator(mode="after")
    def _topk_k_needs_topk(self):
        # topk_k is read only by payload_format topk (or topk_choices, whose options set it): elsewhere it would be
        # silently ignored. The default is not a setting (a dumped and rebuilt dense scenario carries it).
        if (self.payload_format != "topk" and not self.topk_choices
                and self.topk_k != type(self).model_fields["topk_k"].default):
            raise ValueError(f"topk_k: {self.topk_k} is not allowed with payload_format {self.payload_format!r}: "
                             "topk_k is read only when payload_format is 'topk'; set payload_format: topk, or "
                             "leave topk_k out (topk_choices: let the plan choose k)")
        return self

    @field_validator("topk_choices")
    @classmethod
    def _choices(cls, v):
        bad = [k for k in v if k < 1]
        if bad:
            raise ValueError(f"topk_choices: {bad[0]} is not allowed: every k must be an integer >= 1")
        if len(set(v)) != len(v):
            raise ValueError(f"topk_choices: {list(v)} repeats a value; list each k once")
        return tuple(v)

    @field_validator("topk_acceptance_ratio")
    @classmethod
    def _ratios(cls, v):
        for k, r in v.items():
            if k < 1 or not 0 < r <= 10:
                raise ValueError(f"topk_acceptance_ratio: {k}: {r} is not allowed: keys are k >= 1, ratios in (0, 10]")
        return v

    # ---- derived quantities (cheap, used by the model) ----
    @property
    def num_devices(self) -> int:
        """N, the number of devices."""
        return len(self.devices)

    @property
    def noise_psd_w_hz(self) -> float:
        """N_0 in W/Hz: noise_psd_dbm_hz plus noise_figure_db, converted to watts."""
        return radio.noise_psd_w_per_hz(self.noise_psd_dbm_hz, self.noise_figure_db)

    def gains_db(self) -> np.ndarray:
        """g_k in dB per device (negative): channel_gain_db if given, else minus the path loss at distance_m."""
        given = np.array([np.nan if d.channel_gain_db is None else d.channel_gain_db for d in self.devices], float)
        distances = np.array([np.nan if d.distance_m is None else d.distance_m for d in self.devices], float)
        missing = np.isnan(given)
        if missing.any():  # one vectorised path-loss call (a call per device was 1 ms of a 128-device plan)
            given[missing] = radio.gain_from_distance_db(distances[missing], self.path_loss_law)
        return given

    def gains_linear(self) -> np.ndarray:
        """g_k per device as a linear power gain, 10^(dB/10)."""
        return 10.0 ** (self.gains_db() / 10.0)

    def device_array(self, field: str) -> np.ndarray:
        """One per-device field (e.g. 'acceptance', 'draft_time_s') as a float array in device order."""
        return np.array([getattr(d, field) for d in self.devices], dtype=float)

    def ul_bandwidths_hz(self) -> np.ndarray:
        """B^U_k per device, Hz: the device's uplink_bandwidth_hz if set, else the scenario's; with a shared
        uplink the equal share B^U / N (the plan's split replaces it, `testbed.core.uplink`)."""
        if self.ul_access == "fdma_shared":
            return np.full(self.num_devices, self.ul_total_bandwidth_hz() / self.num_devices)
        return np.array([d.uplink_bandwidth_hz or self.uplink_bandwidth_hz for d in self.devices], float)

    def ul_total_bandwidth_hz(self) -> float:
        """B^U of a shared uplink: uplink_total_bandwidth_hz, else N x uplink_bandwidth_hz (the same spectrum as
        dedicated bands)."""
        return float(self.uplink_total_bandwidth_hz or self.num_devices * self.uplink_bandwidth_hz)

    def ul_min_band_hz(self) -> float:
        """b_min, the least share of a shared uplink per device: ul_min_share x B^U / N."""
        return self.ul_min_share * self.ul_total_bandwidth_hz() / self.num_devices

    def fixed_rates_bps(self, direction: str) -> np.ndarray:
        """Per device, the fixed rate of `direction` ("ul" or "dl") in bit/s; NaN where the model's rate holds."""
        field = {"ul": "fixed_ul_rate_bps", "dl": "fixed_dl_rate_bps"}[direction]
        return np.array([np.nan if getattr(d, field) is None else getattr(d, field) for d in self.devices], float)

    def energy_budgets_j(self) -> np.ndarray:
        """E_k per device, J per round; inf where the device has no energy budget."""
        return np.array([np.inf if d.energy_budget_j is None else d.energy_budget_j
                         for d in self.devices], float)

    # ---- rebuilding ----
    def with_updates(self, **fields: Any) -> Scenario:
        """A validated copy with global fields replaced (e.g. downlink_bandwidth_hz=1e7)."""
        data = self.model_dump(exclude_none=True)
        data.update(fields)
        return Scenario.from_dict(data)

    def with_device_updates(self, updates: dict[str, dict[str, Any]] | None = None, *,
                            acceptance: dict[str, float] | None = None,
                            draft_time_s: dict[str, float] | None = None,
                            channel_gain_db: dict[str, float] | None = None,
                            clip_acceptance: bool = True, only: Collection[str] | None = None,
                            fields: dict[str, Any] | None = None) -> Scenario:
        """A validated copy with per-device fields replaced, keyed by device name; with `only`, of those
        devices alone; with `fields`, global fields replaced too (one validation for all of it).

        The live controller calls this each round with online estimates. An acceptance estimate of
        exactly 0 or 1 (all rejected / all accepted so far) is clipped into [1e-3, 1 - 1e-3] unless
        `clip_acceptance` is False, because the model needs alpha in (0, 1). Setting channel_gain_db
        replaces a distance."""
        per: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (updates or {}).items()}
        for field, mapping in (("acceptance", acceptance), ("draft_time_s", draft_time_s),
                               ("channel_gain_db", channel_gain_db)):
            for name, value in (mapping or {}).items():
                per.setdefault(name, {})[field] = value
        names = {d.name for d in self.devices}
        unknown = sorted(set(per) - names)
        if unknown:
            raise ScenarioError(f"unknown device name(s) {unknown}; devices are {sorted(names)}")
        devices = []
        wanted = None if only is None else set(only)
        kept = self.devices if wanted is None else [d for d in self.devices if d.name in wanted]
        for d in kept:
            dd = d.model_dump(exclude_none=True)
            upd = per.get(d.name, {})
            if "channel_gain_db" in upd:
                dd.pop("distance_m", None)
            if "distance_m" in upd:
                dd.pop("channel_gain_db", None)
            dd.update(upd)
            if clip_acceptance and "acceptance" in upd:
                dd["acceptance"] = float(min(max(dd["acceptance"], 1e-3), 1.0 - 1e-3))
            devices.append(dd)
        data = self.model_dump(exclude_none=True, exclude={"devices"})
        data.update(fields or {})
        data["devices"] = devices
        return Scenario.from_dict(data)

    # ---- loading ----
    @classmethod
    def from_dict(cls, data: Any, source: str = "scenario") -> Scenario:
        """A validated Scenario from a mapping; on error a ScenarioError with one line per problem, prefixed by
        `source`."""
        if not isinstance(data, dict):
            raise ScenarioError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ScenarioError(format_validation_error(exc, source)) from None


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith("function-"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _allowed(err: dict) -> str:
    t, ctx, msg = err["type"], err.get("ctx") or {}, err["msg"]
    if t == "extra_forbidden":
        return "unknown field (not part of the schema; check the spelling)"
    if t == "missing":
        return "required field is missing"
    if t == "literal_error":
        return f"must be one of {ctx.get('expected', '')}"
    return msg.replace("Input should be", "must be").replace("Value error, ", "")


def format_validation_error(exc: ValidationError, source: str = "scenario") -> str:
    """One line per problem: `field: value is not allowed: rule`. Ranges on both sides are merged."""
    lines = []
    # pydantic reports one side of a range; the field's full interval (e.g. "(0, 1)") is clearer.
    for err in exc.errors():
        loc = _loc(err["loc"])
        if err["type"] == "missing":
            lines.append(f"{loc}: required field is missing")
            continue
        value = err.get("input")
        rule = _allowed(err)
        bounds = _field_bounds(err["loc"])
        if bounds and err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            rule = f"must be in {bounds}"
        if err["type"] == "value_error" and isinstance(value, dict):
            # A rule across fields names its field first ('topk_k: 64 is not allowed ...'): no '(top level)'.
            named = not err["loc"] and rule.split(": ", 1)[0].isidentifier() and ": " in rule
            lines.append(rule if named else f"{loc}: {rule}")
        else:
            lines.append(f"{loc}: {value!r} is not allowed: {rule}")
    return f"{source} is not valid:\n  " + "\n  ".join(lines)


def _field_bounds(loc: tuple) -> str | None:
    """The allowed interval of a numeric field, e.g. '(0, 1)', looked up from the schema."""
    model: Any = Scenario
    field = None
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        field = fields[part]
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        nested = [a for a in (inner or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = nested[0] if nested else None
    if field is None:
        return None
    lo = hi = None
    lo_open = hi_open = True
    for m in field.metadata:
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "ge", None) is not None:
            lo, lo_open = m.ge, False
        if getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
        if getattr(m, "le", None) is not None:
            hi, hi_open = m.le, False
    if lo is None and hi is None:
        return None
    left = ("(" if lo_open else "[") + (f"{lo:g}" if lo is not None else "-inf")
    right = (f"{hi:g}" if hi is not None else "inf") + (")" if hi_open else "]")
    return f"{left}, {right}"
