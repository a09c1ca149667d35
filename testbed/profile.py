"""The run profile: an analytic `Scenario` plus everything a live run needs (endpoints, processes, channel
emulator, model pair, sampling, prompts, policy, deadlines, hardware per device).

Loaded from YAML with `load_profile(path | dict)`; errors name the field, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from channel_emulator import DEFAULT_SPIN_S
from testbed import PROFILES_DIR
from testbed.errors import TestbedError

DEFAULT_PROFILE = PROFILES_DIR / "emulation.yaml"
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.txt"


class ProfileError(TestbedError, ValueError):
    """A profile that cannot be used; the message names the field."""


class _Strict(BaseModel):
    # No infinities or NaN anywhere in a profile: `deadline_s: .inf` would wait forever.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Endpoints(_Strict):
    # None: chosen by the launcher (ipc:// sockets in a private temp dir for an emulation run).
    edge_bind: str | None = Field(default=None, description="edge ROUTER bind, e.g. tcp://0.0.0.0:5555")
    device_connect: str | None = Field(default=None, description="what devices connect to")
    channel_frontend: str | None = Field(default=None, description="channel emulator frontend bind")
    channel_control: str | None = Field(default=None, description="channel emulator control endpoint")


class ChannelSettings(_Strict):
    mode: Literal["real", "virtual", "passthrough"] = "real"
    base_latency_s: float = Field(default=0.0, ge=0)
    spin_s: float = Field(default=DEFAULT_SPIN_S, ge=0, lt=1, description="busy-wait window of the emulator")
    # ChannelState config (channel_emulator.state): None = the scenario's static gains every round.
    state: dict[str, Any] | None = None


class ModelSettings(_Strict):
    pair: Literal["default", "local"] = "default"
    target: str | None = Field(default=None, description="HF dir or GGUF file of the target (pair: local)")
    draft_onnx: str | None = Field(default=None, description="the draft's ONNX file (pair: local)")
    tokenizer: str | None = Field(default=None, description="tokenizer JSON or HF dir (pair: local)")
    device: str | None = Field(default=None, description="torch device of the target (default: cuda if any)")
    # torch intra-op threads of the edge; on a host shared with emulated devices 1 avoids thread contention
    # (measured here: micro target verify 98 ms with 2 threads under load vs 10 ms with 1).
    threads: int | None = Field(default=None, ge=1, description="None: torch's default")

    @model_validator(mode="after")
    def _local_paths(self):
        if self.pair == "local":
            missing = [f for f in ("target", "draft_onnx", "tokenizer") if not getattr(self, f)]
            if missing:
                raise ValueError(f"model.pair is 'local' but {', '.join('model.' + m for m in missing)} not given")
        return self


class SamplingSettings(_Strict):
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)


class EstimatorSettings(_Strict):
    # alpha_k: Beta posterior with the profile's acceptance as prior mean and this many pseudo-trials.
    alpha_prior_trials: float = Field(default=8.0, ge=0)
    # t_k: median of the device-reported drafting time per token over this many recent rounds.
    draft_time_window: int = Field(default=10, ge=1)
    # T_ver = t0 + t1 * positions: refit from measured verification times after this many rounds.
    fit_verify_after: int = Field(default=5, ge=0, description="0 = keep the profile's t0, t1")
    # T_0: the median residual of the measured round time beyond the modeled phases (last 20 rounds).
    fit_round_overhead: bool = True


class PinSettings(_Strict):
    # Pin every device's mode and/or draft length (None: the policy decides). For experiments such as
    # "UL and DL mode give the same text": same schedule, only the mode differs.
    mode: Literal["UL", "DL"] | None = None
    draft_len: int | None = Field(default=None, ge=1)


class SecuritySettings(_Strict):
    keys: str = Field(description="key directory from `multispin keys generate` (on the edge host)")


INSECURE = "insecure"


class Profile(_Strict):
    name: str = "unnamed"
    deployment: Literal["emulation", "lan"] = "emulation"
    scenario: dict[str, Any]
    endpoints: Endpoints = Endpoints()
    channel: ChannelSettings = ChannelSettings()
    model: ModelSettings = ModelSettings()
    sampling: SamplingSettings = SamplingSettings()
    estimator: EstimatorSettings = EstimatorSettings()
    seed: int = Field(default=0, ge=0)
    rounds: int = Field(default=40, ge=1, description="rounds to run (the run also ends when every session is done)")
    max_new_tokens: int = Field(default=0, ge=0, description="per device session; 0 = no limit")
    prompts: list[str] | None = None
    prompts_file: str | None = None
    policy: str = "proposed"
    fixed_length: int = Field(default=4, ge=1)
    deadline_s: float = Field(default=10.0, gt=0, description="a device's draft must arrive within this")
    max_misses: int = Field(default=2, ge=1, description="consecutive misses before a device leaves the session")
    on_air_vocab_size: int | None = Field(default=None, ge=2, description="pad distributions on the air")
    pin: PinSettings = PinSettings()
    hardware: dict[str, str] = Field(default_factory=dict, description="device name -> hardware profile")
    device_threads: int = Field(default=1, ge=1)
    start_devices: bool = Field(default=True, description="emulation: start one process per scenario device")
    wait_for_devices_s: float = Field(default=120.0, gt=0, description="time to wait for devices to register")
    # None: loopback only (ipc://, 127.x); {keys: DIR}: CURVE on every socket; "insecure": a LAN without keys.
    security: SecuritySettings | Literal["insecure"] | None = None

    @field_validator("security", mode="before")
    @classmethod
    def _security_form(cls, value):
        if value is None or value == INSECURE or isinstance(value, (dict, SecuritySettings)):
            return value
        raise ValueError("must be 'insecure' or a mapping {keys: DIR} (omit it for loopback-only endpoints)")

    @model_validator(mode="after")
    def _check(self):
        from testbed.core.optimizer import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        if self.prompts is not None and not self.prompts:
            raise ValueError("prompts: an empty list is not allowed; give at least one prompt or omit it")
        # Validate the scenario now, not rounds later; the model's vocabulary is filled in at run time.
        from testbed.core.scenario import ScenarioError

        try:
            self.scenario_obj(vocab_size=self.scenario.get("vocab_size") or 2)
        except ScenarioError as exc:
            raise ValueError(f"scenario: {exc}") from None
        return self

    # -- derived ---------------------------------------------------------------------------------
    @property
    def keys_dir(self) -> str | None:
        """The CURVE key directory (`security: {keys: DIR}`), or None."""
        return self.security.keys if isinstance(self.security, SecuritySettings) else None

    @property
    def insecure(self) -> bool:
        """`security: insecure`: serve non-loopback endpoints without keys (logged at every start)."""
        return self.security == INSECURE

    def scenario_obj(self, vocab_size: int | None = None):
        """The analytic scenario; `vocab_size` (the model's) is replaced by the on-air size when set."""
        from testbed.scenario_file import load_scenario

        data = dict(self.scenario)
        v = self.on_air_vocab_size or vocab_size
        if v:
            data["vocab_size"] = int(v)
        return load_scenario(data)

    def device_names(self) -> list[str]:
        return [d["name"] for d in self.scenario.get("devices", [])]

    def prompt_list(self) -> list[str]:
        if self.prompts:
            return list(self.prompts)
        path = Path(self.prompts_file) if self.prompts_file else DEFAULT_PROMPTS
        if not path.is_file():
            raise ProfileError(f"prompts_file: {str(path)!r} not found")
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        prompts = [ln.replace("\\n", "\n") for ln in lines if ln and not ln.startswith("#")]
        if not prompts:
            raise ProfileError(f"prompts_file: {str(path)!r} holds no prompts")
        return prompts

    def snapshot(self) -> dict:
        return self.model_dump(mode="json")


def load_profile(source: str | Path | dict | None = None, overrides: dict | None = None) -> Profile:
    """A validated profile from a path, a name in ``profiles/`` or a dict (None: the default)."""
    if source is None:
        source = DEFAULT_PROFILE
    if isinstance(source, dict):
        data, where = dict(source), "profile"
    else:
        path = Path(source)
        if not path.is_file() and (PROFILES_DIR / f"{source}.yaml").is_file():
            path = PROFILES_DIR / f"{source}.yaml"
        if not path.is_file():
            raise ProfileError(f"profile {str(source)!r} not found (a YAML path or a name in {PROFILES_DIR})")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ProfileError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: must be a YAML mapping")
        where = str(path)
        # Relative file references resolve against the profile's folder (absolute in the run's snapshot,
        # which --resume loads from anywhere).
        for key in ("prompts_file",):
            if data.get(key) and not Path(data[key]).is_absolute():
                data[key] = str((path.parent / data[key]).resolve())
        sec = data.get("security")
        if isinstance(sec, dict) and isinstance(sec.get("keys"), str) and not Path(sec["keys"]).is_absolute():
            data["security"] = {**sec, "keys": str((path.parent / sec["keys"]).expanduser().resolve())}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(profile)"
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" {value!r}"
            lines.append(f"{loc}:{shown} is not allowed: {err['msg']}")
        raise ProfileError(f"{where}:\n  " + "\n  ".join(lines)) from None
    try:
        profile.scenario_obj()
    except ValueError as exc:
        raise ProfileError(f"{where}: scenario: {exc}") from None
    names = set(profile.device_names())
    unknown = sorted(set(profile.hardware) - names)
    if unknown:
        raise ProfileError(f"{where}: hardware: device(s) {unknown} not in scenario.devices {sorted(names)}")
    from device_node.hardware import load_hardware

    for name, hw in profile.hardware.items():
        try:
            load_hardware(hw)  # an unknown name fails here, not in a device process minutes later
        except ValueError as exc:
            raise ProfileError(f"{where}: hardware.{name}: {exc}") from None
    return profile


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    cur = data
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
