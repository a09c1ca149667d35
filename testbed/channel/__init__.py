"""The channel model: channel state (path loss, fading, mobility, traces, live readings) and its sources."""
