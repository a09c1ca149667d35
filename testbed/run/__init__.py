"""Orchestration: profiles and overrides, the launcher, a run's session, campaigns."""
