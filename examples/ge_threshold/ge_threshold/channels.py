"""A two-state Gilbert-Elliott channel: each device's link is good or bad, a Markov chain over rounds.

Gain = minus the path loss at the device's distance, minus ``bad_loss_db`` in the bad state. Parameters
(``Params``; a profile sets them under ``channel.state.params``, checked at load): ``p_good_to_bad`` (0.1)
and ``p_bad_to_good`` (0.3), the per-round transition probabilities, ``bad_loss_db`` (20) and
``path_loss_law`` (3gpp_macro); ``channel.state.gilbert_elliott``, the earlier form, still sets them too.
Seeded by (``channel.state.seed``, device name): the same rounds whatever order they are asked in.
"""

import zlib

import numpy as np

from testbed.channel.source import LinkState
from testbed.core import radio

OPTIONS = {"p_good_to_bad": 0.1, "p_bad_to_good": 0.3, "bad_loss_db": 20.0, "path_loss_law": "3gpp_macro"}


class GilbertElliott:
    """Two-state Markov (good/bad) extra loss on top of the path loss, per device and round."""

    Params = OPTIONS  # the testbed checks channel.state.params against these and passes cfg["params"]

    def __init__(self, cfg: dict, devices: list[dict]):
        opts = {**OPTIONS, **(cfg.get("params") or {}), **(cfg.get("gilbert_elliott") or {})}
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(f"gilbert_elliott: unknown options {unknown}; allowed: {sorted(OPTIONS)}")
        for key in ("p_good_to_bad", "p_bad_to_good"):
            if not 0.0 < float(opts[key]) <= 1.0:
                raise ValueError(f"gilbert_elliott.{key}: {opts[key]!r} is not allowed: must be in (0, 1]")
        self.p_gb, self.p_bg = float(opts["p_good_to_bad"]), float(opts["p_bad_to_good"])
        self.bad_loss_db, seed = float(opts["bad_loss_db"]), int(cfg.get("seed", 0))
        self.path_gain_db, self.rng, self.bad = {}, {}, {}
        for d in devices:
            if not d.get("distance_m"):
                raise ValueError(f"gilbert_elliott: device {d['name']!r} needs a distance_m")
            self.path_gain_db[d["name"]] = -radio.path_loss_db(float(d["distance_m"]), opts["path_loss_law"])
            self.rng[d["name"]] = np.random.default_rng([seed, zlib.crc32(d["name"].encode())])
            self.bad[d["name"]] = []  # the chain so far: bad[r] is round r's state

    def is_bad(self, name: str, round_index: int) -> bool:
        chain, rng = self.bad[name], self.rng[name]
        while len(chain) <= round_index:  # extend the chain in round order, whatever order rounds are asked in
            if not chain:  # the first round from the stationary law
                chain.append(rng.random() < self.p_gb / (self.p_gb + self.p_bg))
            else:
                chain.append(rng.random() < (1.0 - self.p_bg if chain[-1] else self.p_gb))
        return chain[round_index]

    def link_states(self, round_index: int, t_s: float) -> dict:
        return {n: LinkState(gain_db=g - (self.bad_loss_db if self.is_bad(n, round_index) else 0.0))
                for n, g in self.path_gain_db.items()}
