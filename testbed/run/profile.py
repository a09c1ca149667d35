"""The run profile: an analytic `Scenario` plus everything a live run needs (endpoints, processes, channel
emulator, model pair, sampling, prompts, policy, deadlines, hardware per device).

Loaded from YAML with `load_profile(path | dict)`; errors name the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from channel_emulator import DEFAULT_SPIN_S
from testbed import PROFILES_DIR
from testbed.core.scenario import Scenario
from testbed.core.vocabulary import MODES
from testbed.run.config_override import Override, OverrideError, apply_override, attribute, loc_text, rule
from testbed.runtime.errors import TestbedError, did_you_mean
from testbed.wire.protocol import MAX_PROBE_BYTES

DEFAULT_PROFILE = PROFILES_DIR / "emulation.yaml"
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts.txt"


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


CHANNEL_STATE_ERROR = "channel_state"  # the pydantic error type of a channel.state problem


def _builtin_sources():
    from testbed.channel.state import SOURCES

    return SOURCES


class RateProbeSettings(_Strict):
    """Probe sweeps of a measured real link (`measure_links`; edge_node/probing.py, docs/real-links.md)."""

    enabled: bool = Field(default=True, description="sweep each direction at registration and refresh them")
    every_s: float | None = Field(default=30.0, gt=0, description="re-probe a direction measured longer ago "
                                                                  "than this (None: only at registration)")
    budget_s: float = Field(default=1.0, gt=0, le=60, description="time limit of one sweep (one direction)")
    target_s: float = Field(default=0.1, gt=0, le=10, description="sizes grow until a round trip takes this")
    min_bytes: int = Field(default=1024, ge=1, description="the sweep's first size")
    max_bytes: int = Field(default=2**18, ge=1, le=MAX_PROBE_BYTES, description="the sweep's largest size")
    max_time_share: float = Field(default=0.05, gt=0, le=1, description="age refreshes' share of the time at "
                                                                         "most (registration and change sweeps "
                                                                         "not held to it)")

    @model_validator(mode="after")
    def _sizes(self):
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"min_bytes: {self.min_bytes} exceeds max_bytes: {self.max_bytes}")
        return self


class ChannelSettings(_Strict):
    mode: Literal["real", "virtual", "passthrough"] = Field(
        "real", description="real: hold messages for their air time; virtual: annotate only; passthrough: none")
    base_latency_s: float = Field(default=0.0, ge=0, description="latency the emulator adds to every message, s")
    spin_s: float = Field(default=DEFAULT_SPIN_S, ge=0, lt=1, description="busy-wait window of the emulator")
    # ChannelState config (testbed.channel.state): None = the scenario's static gains every round.
    state: dict[str, Any] | None = None
    # passthrough only: the edge estimates each device's UL and DL rate from what it measures and plans with
    # them (testbed.runtime.link_estimate; docs/real-links.md).
    measure_links: bool = False
    rate_probes: RateProbeSettings = RateProbeSettings()  # with measure_links: probe sweeps of each link

    @field_validator("state", mode="before")
    @classmethod
    def _known_source(cls, value):
        # Every key and value of a built-in source's state (testbed.channel.config), before anything starts; the
        # problems travel as one error whose ctx lists them by location (`load_profile` names each one).
        from testbed.channel.config import ChannelConfigError, check_state

        try:
            check_state(value)
        except ChannelConfigError as exc:
            raise PydanticCustomError(CHANNEL_STATE_ERROR, "{message}",
                                      {"message": str(exc), "problems": exc.problems}) from None
        source = value.get("source", "model") if isinstance(value, dict) else "model"
        if source not in _builtin_sources():
            from testbed.runtime.plugins import channel_source_params, load_channel_source

            load_channel_source(source)  # imported now: a bad path or interface fails before any run starts
            channel_source_params(value)  # channel.state.params against the source's Params, named
        return value

    @model_validator(mode="after")
    def _measure_needs_passthrough(self):
        if self.measure_links and self.mode != "passthrough":
            raise ValueError(f"measure_links: true needs mode: passthrough (a real link), not {self.mode!r}: an "
                             "emulator already fixes the rates")
        return self


class ModelSettings(_Strict):
    pair: Literal["default", "local"] = Field("default", description="the shipped default pair, or local files "
                                                                     "(name, or target + draft_onnx + tokenizer)")
    # A pair in the model cache by name: <$MULTISPIN_CACHE or ~/.cache/multispin>/models/NAME/ (docs/models.md);
    # target/draft_onnx/tokenizer then default to its files and, given, are relative to it.
    name: str | None = Field(default=None, description="a pair in the model cache (pair: local)")
    target: str | None = Field(default=None, description="HF dir or GGUF file of the target (pair: local)")
    draft_onnx: str | None = Field(default=None, description="the draft's ONNX file (pair: local)")
    tokenizer: str | None = Field(default=None, description="tokenizer JSON or HF dir (pair: local)")
    device: str | None = Field(default=None, description="torch device of the target (default: cuda if any)")
    # bfloat16 on a CPU with AMX (this host): the Qwen 1.5B target verified 2 devices in 366 ms against 1,584 ms
    # in float32 (tools/bench_verifier.py --compare-dtype); another target, so lossless against itself only.
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="the target's weights and compute: float32 (exact against the float32 "
                                       "checkpoint), bfloat16 or float16 (faster where the hardware has them)")
    # torch intra-op threads of the edge (edge_node.verifier.auto_threads: 1 for a small target, whose ops are too
    # short to pay for a thread barrier and stall 25x when another process holds a core; torch's default above).
    threads: int | Literal["auto"] | None = Field(
        default="auto", description="torch threads of the target: auto (1 below 50 M parameters, else torch's "
                                    "default), a number >= 1, or null (torch's default)")

    @field_validator("threads")
    @classmethod
    def _threads(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}: must be >= 1, auto or null")
        return v

    @model_validator(mode="after")
    def _local_paths(self):
        from model_pairs.cache import NamedPairError, expand_path, resolve_named_pair

        if self.name is not None:
            if self.pair != "local":
                raise ValueError(f"model.name {self.name!r} names a pair in the model cache: set model.pair: local")
            try:
                paths = resolve_named_pair(self.name, self.target, self.draft_onnx, self.tokenizer)
            except NamedPairError as exc:
                raise ValueError(str(exc)) from None
            for key, value in paths.items():
                setattr(self, key, value)
        elif self.pair == "local":  # ${MULTISPIN_CACHE} and ~ expanded; existence checked when the run starts
            for key in ("target", "draft_onnx", "tokenizer"):
                if getattr(self, key):
                    setattr(self, key, str(expand_path(getattr(self, key))))
        if self.pair == "local":
            missing = [f for f in ("target", "draft_onnx", "tokenizer") if not getattr(self, f)]
            if missing:
                raise ValueError(f"model.pair is 'local' but {', '.join('model.' + m for m in missing)} not given")
        return self


class SamplingSettings(_Strict):
    temperature: float = Field(default=1.0, ge=0, description="0: greedy (the target's argmax)")
    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens; 0: off")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling mass; 1: off")


class EstimatorSettings(_Strict):
    # alpha_k: Beta posterior with the profile's acceptance as prior mean and this many pseudo-trials.
    alpha_prior_trials: float = Field(default=8.0, ge=0)
    # t_k: median of the device-reported drafting time per token over this many recent rounds.
    draft_time_window: int = Field(default=10, ge=1)
    # T_ver = t0 + t1 * positions: refit from measured verification times after this many rounds.
    fit_verify_after: int = Field(default=3, ge=0, description="0 = keep the profile's t0, t1")
    # T_0: the median residual of the measured round time beyond the modeled phases (last 20 rounds).
    fit_round_overhead: bool = True
    # Before round 0: each device's drafting time per token as it timed itself (its `register`), and t0, t1
    # timed on the target at a few batch shapes, replace the priors (false: round 0 is planned on the priors).
    calibrate: bool = True


class PinSettings(_Strict):
    # Pin every device's mode and/or draft length (None: the policy decides). For experiments such as
    # "UL and DL mode give the same text": same schedule, only the mode differs.
    mode: Literal[MODES] | None = None  # Literal[("UL", "DL")] is Literal["UL", "DL"]
    draft_len: int | None = Field(default=None, ge=1, description="every device's draft length (null: planned)")


class RequestSettings(_Strict):
    """Request-level serving (docs/serving-metrics.md): each device serves a queue of requests, each a fresh
    generation of at most `max_new_tokens` tokens from a prompt of the prompt set."""

    arrival: Literal["closed", "poisson", "trace"] = Field(
        default="closed", description="closed: the next request as the previous completes; poisson: at "
                                      "rate_per_s; trace: the arrival times in `trace`")
    rate_per_s: float | None = Field(default=None, gt=0, description="poisson: requests per second per device")
    trace: str | None = Field(default=None, description="trace: a file of arrival times (s), one per line, each "
                                                        "optionally followed by the device's name")
    count: int = Field(default=4, ge=1, le=100_000, description="requests per device (closed, poisson)")
    prompts: str = Field(default="shipped", description="shipped (testbed/data/prompts.txt), a .txt or .jsonl "
                                                        "file, or hf:DATASET[:SPLIT] (Hugging Face, offline)")
    prompt_field: str = Field(default="prompt", description="the JSONL / dataset field holding the prompt text")
    max_new_tokens: int = Field(default=32, ge=1, le=100_000, description="tokens generated per request at most")
    seed: int | None = Field(default=None, ge=0, description="arrivals and prompt draws (default: the run's seed)")

    @model_validator(mode="after")
    def _arrival_inputs(self):
        if self.arrival == "poisson" and self.rate_per_s is None:
            raise ValueError("arrival: poisson needs rate_per_s (requests per second per device)")
        if self.arrival != "poisson" and self.rate_per_s is not None:
            raise ValueError(f"rate_per_s applies to arrival: poisson, not {self.arrival!r}")
        if self.arrival == "trace" and not self.trace:
            raise ValueError("arrival: trace needs trace: a file of arrival times")
        if self.arrival != "trace" and self.trace:
            raise ValueError(f"trace applies to arrival: trace, not {self.arrival!r}")
        return self


class SecuritySettings(_Strict):
    keys: str = Field(description="key directory from `multispin keys generate` (on the edge host)")


INSECURE = "insecure"


class Profile(_Strict):
    MAPPING_SCHEMAS: ClassVar[dict] = {"scenario": Scenario}  # the free-form scenario, checked by --set
    name: str = Field("unnamed", description="the profile's name (in the run directory's name and meta.json)")
    deployment: Literal["emulation", "lan"] = Field(
        "emulation", description="emulation: every process on this host; lan: devices on other hosts")
    scenario: dict[str, Any] = Field(description="the system model's parameters and devices (`scenario`, below)")
    endpoints: Endpoints = Endpoints()
    channel: ChannelSettings = ChannelSettings()
    model: ModelSettings = ModelSettings()
    sampling: SamplingSettings = SamplingSettings()
    estimator: EstimatorSettings = EstimatorSettings()
    seed: int = Field(default=0, ge=0, description="every random draw of the run (sampling, channel, policy)")
    rounds: int = Field(default=40, ge=1, description="rounds to run (the run also ends when every session is done)")
    max_new_tokens: int = Field(default=0, ge=0, description="per device session; 0 = no limit")
    prompts: list[str] | None = Field(default=None, description="one per device, round robin (null: shipped)")
    prompts_file: str | None = Field(default=None, description="a file of prompts, one per line")
    # None: each device generates from one prompt for the whole run (as before); set: it serves requests.
    requests: RequestSettings | None = None
    policy: str = Field("proposed", description="a built-in policy or a plug-in (module:Class, entry point)")
    # Plug-in policies' parameters by policy name (each checked against the plug-in's Params at load; a compare
    # or campaign gives each plug-in its own): {NAME: {PARAM: VALUE}}.
    policy_params: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                     description="plug-in policy name -> its parameters")
    # A plug-in (policy, channel source) that raises while the run plans: stop the run (exit status 3), or
    # plan that round without it (`fallback_policy`; the channel: the scenario's static gains), status degraded.
    on_plugin_error: Literal["stop", "fallback"] = "stop"
    fallback_policy: str = Field(default="all-dl", description="the built-in policy a round falls back to")
    fixed_length: int = Field(default=4, ge=1, description="the draft length of the fixed-length policy")
    deadline_s: float = Field(default=10.0, gt=0, description="a device's draft must arrive within this")
    max_misses: int = Field(default=2, ge=1, description="consecutive misses before a device leaves the session")
    max_invalid_payloads: int = Field(default=3, ge=1, description="drafts in a row whose distributions are not "
                                      "distributions (NaN, negative, ...) before the edge ends the device's session")
    # Synchronous rounds (edge_node/bench.py): a device that misses this many rounds in a row is benched, rounds no
    # longer wait for its draft until it drafts in time again; below max_misses, which would end its session first.
    straggler_misses: int = Field(default=0, ge=0, description="consecutive misses before rounds stop waiting "
                                  "for a device (it stays registered and rejoins once in time); 0: never")
    # Liveness (the ZeroMQ guide's Paranoid Pirate): a peer silent for liveness x heartbeat_s is gone. A slow
    # real link needs a window longer than its largest message's transfer (a TCP stall after a rate drop).
    heartbeat_s: float = Field(default=1.0, ge=0.01, le=3600, description="seconds between heartbeats")
    liveness: int = Field(default=5, ge=1, le=1000, description="heartbeats missed before a peer counts as gone")
    on_air_vocab_size: int | None = Field(default=None, ge=2, description="pad distributions on the air")
    pin: PinSettings = PinSettings()
    hardware: dict[str, str] = Field(default_factory=dict, description="device name -> hardware profile")
    # Emulated devices' link probes (device_node.link_probe SPEC, e.g. file:/tmp/dev0.snr), for
    # channel.state.source: live; a LAN device takes --link-probe itself.
    link_probe: dict[str, str] = Field(default_factory=dict, description="device name -> link probe SPEC")
    link_probe_period_s: float = Field(default=1.0, gt=0, description="seconds between two link measurements")
    start_devices: bool = Field(default=True, description="emulation: start one process per scenario device")
    # Emulation at scale: k devices per process share one onnxruntime session (device_node.host); each keeps
    # its own identity, KV cache, seeds and measured drafting time. 1: one process per device.
    devices_per_process: int = Field(default=1, ge=1, le=1024, strict=True,
                                     description="emulation: devices per device process (one onnxruntime session)")
    wait_for_devices_s: float = Field(default=120.0, gt=0, description="time to wait for devices to register")
    # Busy-poll sockets instead of sleeping in the kernel (testbed.runtime.waiting): 0.3-0.5 ms less per message
    # on a virtual machine, a core per waiting process. auto: on when the run starts its devices here and each
    # of its processes (edge, emulator, device processes) has a core of its own, off while links are measured;
    # devices sharing a process never busy-poll.
    busy_poll: Literal["auto", "on", "off"] = Field(default="auto", description="busy-poll sockets: auto | on | off")
    # None: each round's record (and progress line) is fsynced as it is written, by a thread of the recorder
    # (0.2 ms of I/O a line; measured 0.4-0.6 ms of a round on 2 busy cores). A number: fsynced inline at most
    # that often (0: after every line), so a power cut may lose that many seconds of lines.
    records_sync_interval_s: float | None = Field(default=None, ge=0, le=3600,
                                                  description="fsync the logs at most this often (null: each line)")
    # None: loopback only (ipc://, 127.x); {keys: DIR}: CURVE on every socket; "insecure": a LAN without keys.
    security: SecuritySettings | Literal["insecure"] | None = None

    @field_validator("security", mode="before")
    @classmethod
    def _security_form(cls, value):
        if value is None or value == INSECURE or isinstance(value, (dict, SecuritySettings)):
            return value
        raise ValueError("must be 'insecure' or a mapping {keys: DIR} (omit it for loopback-only endpoints)")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value):
        from testbed.runtime.plugins import check_policy

        check_policy(value)  # a plug-in is imported now: a bad path or interface fails before any run starts
        return value

    @field_validator("fallback_policy")
    @classmethod
    def _builtin_fallback(cls, value):
        from testbed.core.optimizer import POLICIES
        from testbed.runtime.errors import did_you_mean

        if value not in POLICIES:
            raise ValueError(f"must be a built-in policy{did_you_mean(value, POLICIES)} (a fallback must not fail "
                             f"as a plug-in may; allowed: {', '.join(POLICIES)})")
        return value

    @field_validator("policy_params")
    @classmethod
    def _known_params(cls, value):
        from testbed.runtime.plugins import load_policy

        for name, params in value.items():
            load_policy(name, params)  # unknown parameters (or a plug-in without Params) fail now, named
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.prompts is not None and not self.prompts:
            raise ValueError("prompts: an empty list is not allowed; give at least one prompt or omit it")
        # Validate the scenario now, not rounds later; the model's vocabulary is filled in at run time.
        from testbed.core.scenario import ScenarioError

        try:
            self.scenario_obj(vocab_size=self.scenario.get("vocab_size") or 2)
        except ScenarioError as exc:
            raise ValueError(f"scenario: {exc}") from None
        if self.straggler_misses and self.straggler_misses >= self.max_misses:
            raise ValueError(f"straggler_misses: {self.straggler_misses} must be below max_misses "
                             f"({self.max_misses}): the session would end before the device is benched")
        if self.requests is not None and self.scenario.get("rounds") == "asynchronous":
            raise ValueError("requests: serving requests needs synchronous rounds (scenario.rounds), not asynchronous")
        if self.requests is not None and self.max_new_tokens:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} is per session; with requests: set "
                             f"requests.max_new_tokens instead (per request)")
        if self.scenario.get("rounds") == "asynchronous" and self.channel.mode == "virtual":
            # edge_node.async_rounds: the virtual clock reconstructs synchronous rounds only
            raise ValueError("scenario.rounds: asynchronous needs channel.mode real or passthrough, not virtual")
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
        from testbed.run.scenario_file import load_scenario

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


def profile_names() -> list[str]:
    """Names a command accepts instead of a path: run profiles in profiles/, scenarios in profiles/scenarios/."""
    return sorted({p.stem for d in (PROFILES_DIR, PROFILES_DIR / "scenarios") for p in d.glob("*.yaml")})


def find_profile(source: str | Path | None, default: Path = DEFAULT_PROFILE) -> Path:
    """The one profile resolution of every command: None -> `default`; an existing file; else a name (with or
    without .yaml) in profiles/ or profiles/scenarios/. A ProfileError lists the names and a did-you-mean."""
    if source is None:
        return default
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ProfileError(f"profile {str(source)!r} is a folder; give a YAML file or a profile name")
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if path.parent == Path("."):
        for folder in (PROFILES_DIR, PROFILES_DIR / "scenarios"):
            if (folder / f"{stem}.yaml").is_file():
                return folder / f"{stem}.yaml"
    elif not path.is_absolute() and path.parts[0] == "profiles" and (PROFILES_DIR.joinpath(*path.parts[1:])).is_file():
        return PROFILES_DIR.joinpath(*path.parts[1:])  # the README's paths work outside a checkout too
    names = profile_names()
    raise ProfileError(f"profile {str(source)!r} not found{did_you_mean(stem, names)} (a YAML path, or a name in "
                       f"{PROFILES_DIR}: {', '.join(names)})")


def _read_source(source: str | Path | dict | None) -> tuple[dict, str]:
    """The profile mapping and where it came from (the file, or 'profile' for a mapping)."""
    if isinstance(source, dict):
        return dict(source), "profile"
    path = find_profile(source)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: must be a YAML mapping")
    if "devices" in data and "scenario" not in data:
        raise ProfileError(f"{path} is a scenario file, not a run profile (no scenario: section); plan or simulate "
                           f"it (multispin plan {source}), or run a profile such as emulation")
    # Relative file references resolve against the profile's folder (absolute in the run's snapshot,
    # which --resume loads from anywhere).
    for key in ("prompts_file",):
        if data.get(key) and not Path(data[key]).is_absolute():
            data[key] = str((path.parent / data[key]).resolve())
    req = data.get("requests")
    if isinstance(req, dict):  # the trace and a prompt file, likewise
        data["requests"] = req = dict(req)
        for key in ("trace", "prompts"):
            value = req.get(key)
            if isinstance(value, str) and value != "shipped" and not value.startswith("hf:") \
                    and not Path(value).expanduser().is_absolute():
                req[key] = str((path.parent / value).resolve())
    sec = data.get("security")
    if isinstance(sec, dict) and isinstance(sec.get("keys"), str) and not Path(sec["keys"]).is_absolute():
        data["security"] = {**sec, "keys": str((path.parent / sec["keys"]).expanduser().resolve())}
    return data, str(path)


def _as_overrides(overrides: dict | list[Override] | None) -> list[Override]:
    if not overrides:
        return []
    if isinstance(overrides, dict):  # the library's form: {dotted key: value}
        return [Override(k, v, f"override {k}={v!r}") for k, v in overrides.items()]
    return list(overrides)


def _scenario_problems(data: dict) -> list[tuple[tuple, str, str]]:
    """(loc, full line, rule) per problem of the scenario section, with locations under `scenario`."""
    from testbed.core.scenario import Scenario, format_validation_error

    scen = data.get("scenario")
    if not isinstance(scen, dict):
        return []  # the profile's own validation says what is wrong with it
    try:
        Scenario.model_validate({**scen, "vocab_size": scen.get("vocab_size") or 2})
    except ValidationError as exc:
        lines = format_validation_error(exc, "scenario").splitlines()[1:]  # one line per error, in order
        out = []
        for err, line in zip(exc.errors(), lines):
            loc = ("scenario", *err["loc"])
            text = "scenario." + line.strip()
            if err["type"] == "extra_forbidden":
                text = f"{loc_text(loc)}: {rule(err, Scenario)}"
            rest = text.split(": ", 1)[1] if ": " in text else text
            out.append((loc, text, rest.split(" is not allowed: ", 1)[-1]))
        return out
    return []


def load_profile(source: str | Path | dict | None = None,
                 overrides: dict | list[Override] | None = None) -> Profile:
    """A validated profile from a path, a name in ``profiles/`` or a dict (None: the default), with
    `overrides` ({dotted key: value}, or `Override`s from the command line) applied. A ProfileError names
    each problem where it came from: the flag for an override, the file (or 'profile') otherwise."""
    data, where = _read_source(source)
    applied: dict[tuple, Override] = {}
    for ov in _as_overrides(overrides):
        try:
            applied[apply_override(data, ov, root=Profile)] = ov
        except OverrideError as exc:
            raise ProfileError(str(exc)) from None
    flagged: list[str] = []
    in_file: list[str] = []

    def problem(loc: tuple, line: str, why: str) -> None:
        ov = attribute(loc, applied)
        if ov is None:
            in_file.append(line)
        else:  # the flag's own value: just the rule; a field below it: the field too
            exact = next(p for p, o in applied.items() if o is ov) == loc
            flagged.append(f"{ov.flag}: {why}" if exact else f"{ov.flag}: {line}")

    scenario_problems = _scenario_problems(data)
    for loc, line, why in scenario_problems:
        problem(loc, line, why)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            if not loc and scenario_problems and "scenario" in err["msg"]:
                continue  # the same scenario problems, already listed field by field
            if err["type"] == CHANNEL_STATE_ERROR:  # one line per key of channel.state, each named where it is
                for sub, line in err["ctx"]["problems"]:
                    problem(loc + tuple(sub), line, line.split(": ", 1)[1] if line.startswith("channel.") else line)
                continue
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" {value!r}"
            why = rule(err, Profile)
            problem(loc, f"{loc_text(loc)}:{shown} is not allowed: {why}", why)
        profile = None
    if flagged or in_file:
        raise ProfileError("\n".join(flagged + ([f"{where}:\n  " + "\n  ".join(in_file)] if in_file else [])))
    assert profile is not None

    def origin(*prefixes: tuple) -> str:
        """Where a cross-field problem comes from: the overrides that touched these sections, or the file."""
        flags = [o.flag for p, o in applied.items() if any(p[:len(x)] == x for x in prefixes)]
        return ", ".join(flags) + (f" ({where})" if where != "profile" else "") if flags else where

    try:
        profile.scenario_obj()
    except ValueError as exc:
        raise ProfileError(f"{origin(('scenario',))}: scenario: {exc}") from None
    from device_node.hardware import load_hardware
    from device_node.link_probe import make_probe

    names = set(profile.device_names())
    # Per-device maps, each value checked here: an unknown name fails now, not in a device process minutes later.
    for key, per_device, check, also in (("hardware", profile.hardware, load_hardware, (("scenario", "devices"),)),
                                         ("link_probe", profile.link_probe, make_probe, ())):
        unknown = sorted(set(per_device) - names)
        if unknown:
            raise ProfileError(f"{origin((key,), *also)}: {key}: device(s) {unknown} not in scenario.devices "
                               f"{sorted(names)}")
        for name, value in per_device.items():
            try:
                check(value)
            except ValueError as exc:
                raise ProfileError(f"{origin((key,))}: {key}.{name}: {exc}") from None
    return profile


def plan_overrides(overrides: list[Override] | None, run_profile: bool, where: str) -> list[Override]:
    """`--set` of the analytic commands (`plan`) in the form the file at `where` takes. A run profile: its own
    keys (``scenario.devices.dev0.distance_m``, ``on_air_vocab_size``) as they are, a key of its scenario
    (``devices.dev0.distance_m``) under ``scenario.`` (a name in both, ``rounds``, is the profile's). A scenario
    file: its keys, with a leading ``scenario.`` dropped; a run profile's key is refused, naming the file."""
    from testbed.core.scenario import Scenario

    prof, scen = list(Profile.model_fields), list(Scenario.model_fields)
    out = []
    for ov in overrides or []:
        head, _, rest = ov.key.partition(".")
        if run_profile:
            if head not in prof:
                if head not in scen:
                    raise ProfileError(f"{ov.flag}: unknown key {head!r}: neither a field of the run profile {where} "
                                       f"nor of its scenario: section{did_you_mean(head, prof + scen)}")
                ov = replace(ov, key=f"scenario.{ov.key}")
        elif head == "scenario":
            if not rest:
                raise ProfileError(f"{ov.flag}: {where} is a scenario file: set its fields, e.g. "
                                   f"--set devices.0.distance_m=50")
            ov = replace(ov, key=rest)
        elif head not in scen:
            hint = (f"; {head!r} is a run profile's field, and {where} is a scenario file (plan a run profile to "
                    f"set it)" if head in prof else did_you_mean(head, scen) or f" (keys: {', '.join(scen)})")
            raise ProfileError(f"{ov.flag}: unknown key {head!r} in the scenario {where}{hint}")
        out.append(ov)
    return out


def _scenario_with_overrides(data: Any, overrides: list[Override], where: str):
    """A scenario file's mapping with `overrides` applied, validated; a problem an override made is named by
    its flag, the file's own by the file."""
    from testbed.core.scenario import Scenario, ScenarioError, format_validation_error

    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    applied: dict[tuple, Override] = {}
    for ov in overrides:
        try:
            applied[apply_override(data, ov, root=Scenario)] = ov
        except OverrideError as exc:
            raise ProfileError(str(exc)) from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = [ln.strip() for ln in format_validation_error(exc, where).splitlines()[1:]]
        flagged, in_file = [], []
        for err, line in zip(exc.errors(), lines):
            ov = attribute(tuple(err["loc"]), applied)
            if ov is None:
                in_file.append(line)
            else:
                exact = next(p for p, o in applied.items() if o is ov) == tuple(err["loc"])
                flagged.append(f"{ov.flag}: " + (line.split(" is not allowed: ", 1)[-1] if exact else line))
        raise ProfileError("\n".join(flagged + ([f"{where}:\n  " + "\n  ".join(in_file)] if in_file else []))) \
            from None


@dataclass
class PlanSource:
    """What an analytic command plans: the scenario, a note on where it came from (None for a scenario file),
    the run profile when the source is one, and the resolved config (`--print-config`)."""

    scenario: Any
    config: dict
    note: str | None = None
    profile: Profile | None = None


def resolve_plan_source(source: str | Path | None, overrides: list[Override] | None = None,
                        default: Path | None = None) -> PlanSource:
    """The scenario of `plan` (and `simulate`): a scenario file, or a run profile (then its ``scenario:``
    section, with the on-air vocabulary; its top-level `rounds` etc. are the run's, not the scenario's), with
    `--set` overrides in either form (`plan_overrides`)."""
    path = find_profile(source, default or PROFILES_DIR / "scenarios" / "default.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("scenario"), dict):
        profile = load_profile(path, plan_overrides(overrides, True, str(path)))
        sc = profile.scenario_obj()
        return PlanSource(scenario=sc, profile=profile, config=profile.snapshot(),
                          note=f"{path} is a run profile: using its scenario: section ({sc.num_devices} devices, "
                               f"vocab_size {sc.vocab_size})")
    if not overrides:
        from testbed.run.scenario_file import load_scenario

        sc = load_scenario(path)
    else:
        sc = _scenario_with_overrides(data, plan_overrides(overrides, False, str(path)), str(path))
    return PlanSource(scenario=sc, config=sc.model_dump(mode="json"))


def load_plan_scenario(source: str | Path | None, default: Path | None = None):
    """(Scenario, note) of `resolve_plan_source` without overrides; `note` says a run profile's scenario:
    section was used (None for a plain scenario file)."""
    src = resolve_plan_source(source, default=default)
    return src.scenario, src.note
