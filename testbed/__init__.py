"""Multi-SPIN testbed, in layers: the pure model (`core`), the protocol (`wire`), the channel model (`channel`),
what node processes share (`runtime`), orchestration (`run`), reading runs (`analysis`) and the `multispin`
command (`cli`). docs/architecture.md has the table of what may import what."""

from pathlib import Path

__version__ = "0.1.0"

# Shipped profiles are package data, so a plain `pip install .` finds them too.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
