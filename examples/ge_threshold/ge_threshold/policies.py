"""A channel-threshold policy: UL mode where the channel is strong enough to carry the draft distributions,
DL mode elsewhere; each device drafts one token more than it had accepted last round."""

from testbed.core.policy import Decision


class ChannelThreshold:
    """UL mode for a gain at or above threshold_db, else DL; L = last accepted + 1 (start: draft_len)."""

    name = "channel-threshold"
    # Its parameters, with their defaults: a profile sets them under policy_params (docs/extending.md), e.g.
    #   policy_params: {channel-threshold: {threshold_db: -95}}
    # and the class is constructed with them as keywords; a name not listed here is refused at profile load.
    Params = {"threshold_db": -100.0, "draft_len": 4}

    def __init__(self, threshold_db: float = -100.0, draft_len: int = 4):
        self.threshold_db, self.draft_len = float(threshold_db), int(draft_len)

    def decide(self, scenario, context):
        gains = scenario.gains_db()  # the controller's current estimate of each device's channel, dB
        modes = ["UL" if g >= self.threshold_db else "DL" for g in gains]
        previous = context.previous.devices if context.previous else {}
        lens = []
        for d in scenario.devices:
            last = previous.get(d.name)
            if last is None or last.n_accepted is None:  # no round yet, or it missed the last one
                want = self.draft_len
            else:
                want = last.n_accepted + 1
            lens.append(max(1, min(want, scenario.max_draft_len)))
        return Decision(modes=modes, draft_lens=lens, info={"threshold_db": self.threshold_db})
