"""Example multispin plug-ins (docs/extending.md): `policies.ChannelThreshold` and `channels.GilbertElliott`."""
