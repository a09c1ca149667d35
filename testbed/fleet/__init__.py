"""`multispin fleet up|check|down FLEET.yaml`: physical device hosts on a LAN, prepared, checked, started and
stopped over SSH (asyncssh). The fleet file (`schema`) names the hosts and which devices run where; `sync`
copies keys and the drafter when changed, `install` checks or makes the host's Python environment, `check`
prints one table of what is wrong and how to fix it, `control` starts and stops the host-side `supervisor`.
Nothing here runs on the edge's critical path; only the CLI imports this package."""
