"""The channel source interface: the channel state of every device, round by round.

A channel source is a class constructed as ``Source(cfg, devices)`` (`cfg`: the profile's ``channel.state``
mapping, its ``seed`` filled in from the run's; `devices`: the scenario's device mappings, ``name`` and
``distance_m``, ``max_power_w``, ...) whose instances answer ``link_states(round_index, t_s)`` with one
`LinkState` per device name. It sees the round index and the channel clock (s since the edge started),
never tokens, messages or sockets. The built-in sources (``model``, ``trace``, ``live`` in
`testbed.channel.state`) implement it; a plug-in is named by ``source: module:Class`` or by an entry point
of the ``multispin.channels`` group (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class LinkState:
    """One device's channel in one round. Give a gain or an SNR (else the device's `distance_m` path loss
    stands in); a rate fixes that link's rate as a rate trace does (power control then has no effect on it).

    gain_db: power gain g_k in dB (negative). snr_db: an SNR at the device's reference power and UL bandwidth
    (its ``max_power_w`` and ``ul_bandwidth_hz``, else ``channel.state.snr_reference``), turned into a gain.
    ul_rate_bps, dl_rate_bps: fixed rates in bit/s (floored at ``trace.min_rate_bps``, default 10 kbit/s)."""

    gain_db: float | None = None
    snr_db: float | None = None
    ul_rate_bps: float | None = None
    dl_rate_bps: float | None = None


@runtime_checkable
class ChannelSource(Protocol):
    """The channel state per device per round."""

    def link_states(self, round_index: int, t_s: float) -> Mapping[str, LinkState]:
        """device name -> its `LinkState` for this round, every device of the scenario."""
