"""`sampling.verify_draft`: the edge's decision in both modes (golden cases, seeded determinism, one verifier)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.core.sampling import (
    RoundRandomness,
    Verdict,
    count_accepted,
    sample_correction,
    sample_from,
    speculative_round,
    verify_draft,
)


class FixedDraws:
    """Stands in for RoundRandomness with chosen uniforms, so the golden cases can be worked by hand."""

    def __init__(self, accept, final):
        self.accept, self.final = np.asarray(accept, float), float(final)

    def acceptance_uniforms(self, n):
        return self.accept[:n]

    def final_uniform(self):
        return self.final


Q = np.array([[0.1, 0.5, 0.2, 0.2],
              [0.25, 0.25, 0.25, 0.25]])
P = np.array([[0.1, 0.6, 0.2, 0.1],
              [0.4, 0.4, 0.0, 0.2],
              [0.0, 0.0, 0.5, 0.5]])
DRAWS = FixedDraws([0.9, 0.3], 0.7)


def _verify(tokens, mode, q_rows=Q):
    toks = np.asarray(tokens)
    return verify_draft(P, Q[np.arange(len(toks)), toks], q_rows, toks, mode, DRAWS)


def test_golden_rejection_ul_corrects_dl_leaves_it_to_the_device():
    # x_1 = 1: 0.9 * 0.5 < 0.6, accepted; x_2 = 2: p = 0 always rejects. The residual max(0, p_2 - q_2) is
    # [0.15, 0.15, 0, 0]; u = 0.7 falls in its second half: token 1.
    assert _verify([1, 2], "UL") == Verdict(1, 1)
    assert _verify([1, 2], "DL") == Verdict(1, None)
    assert _verify([1, 2], "DL", q_rows=None) == Verdict(1, None)  # DL mode needs no draft rows
    # The device's DL correction with the same draw gives the token UL mode gave.
    assert sample_correction(P[1], Q[1], DRAWS.final_uniform()) == 1


def test_golden_first_rejected_and_all_accepted():
    # x_1 = 3: 0.9 * 0.2 >= 0.1, rejected at once; the residual [0, 0.1, 0, 0] leaves only token 1.
    assert _verify([3, 0], "UL") == Verdict(0, 1)
    # x_1 = 1 and x_2 = 0 (0.3 * 0.25 < 0.4) accepted: the bonus from p_3 = [0, 0, .5, .5], u = 0.7 -> 3, in
    # both modes (the edge samples the bonus itself).
    assert _verify([1, 0], "UL") == Verdict(2, 3)
    assert _verify([1, 0], "DL") == Verdict(2, 3)


def test_refuses_a_bad_mode_missing_rows_and_a_short_p():
    with pytest.raises(ValueError, match="mode"):
        _verify([1, 2], "up")
    with pytest.raises(ValueError, match="q_rows"):
        _verify([1, 2], "UL", q_rows=None)
    with pytest.raises(ValueError, match="p_rows"):
        verify_draft(P[:2], [0.5, 0.25], Q, [1, 0], "UL", DRAWS)


def _random_round(r, V=12, L=4):
    rng = np.random.default_rng(r)
    q = rng.dirichlet(np.full(V, 0.3), size=L)
    p = rng.dirichlet(np.full(V, 0.3), size=L + 1)
    toks = np.array([rng.choice(V, p=row) for row in q])
    return p, q, toks


def _old_edge_decision(p, q, toks, mode, rr):
    """The composition verify_draft replaced (edge_node/server.py and tools/bench_overhead.py before)."""
    L = len(toks)
    n = count_accepted(toks, q[np.arange(L), toks], p[np.arange(L), toks], rr.acceptance_uniforms(L))
    if n == L:
        return n, sample_from(p[L], rr.final_uniform())
    if mode == "UL":
        return n, sample_correction(p[n], q[n], rr.final_uniform())
    return n, None


def test_seeded_determinism_and_one_verifier_for_both_modes():
    rejections = 0
    for r in range(200):
        p, q, toks = _random_round(r)
        q_at = q[np.arange(len(toks)), toks]
        ul = verify_draft(p, q_at, q, toks, "UL", RoundRandomness(3, "dev", r))
        # The same (seed, device, round) gives the same verdict, whoever asks and however often.
        assert verify_draft(p, q_at, q, toks, "UL", RoundRandomness(3, "dev", r)) == ul
        assert (ul.n_accepted, ul.token) == _old_edge_decision(p, q, toks, "UL", RoundRandomness(3, "dev", r))
        assert (ul.n_accepted, ul.token) == speculative_round(toks, q, p, RoundRandomness(3, "dev", r))
        dl = verify_draft(p, q_at, None, toks, "DL", RoundRandomness(3, "dev", r))
        assert dl.n_accepted == ul.n_accepted
        if dl.token is None:  # the device corrects with its own q_j and the same final draw
            rejections += 1
            assert sample_correction(p[dl.n_accepted], q[dl.n_accepted],
                                     RoundRandomness(3, "dev", r).final_uniform()) == ul.token
        else:
            assert dl.token == ul.token
    assert rejections > 20  # the DL correction path was exercised
    # Another device (or round) draws other uniforms: the verdicts are not all the same.
    p, q, toks = _random_round(0)
    q_at = q[np.arange(len(toks)), toks]
    verdicts = {verify_draft(p, q_at, q, toks, "UL", RoundRandomness(3, f"dev-{i}", 0)) for i in range(30)}
    assert len(verdicts) > 1


def test_the_edges_draws_made_ahead_are_the_rounds_draws():
    """The edge makes a round's verification draws while the device drafts (`DrawsAhead`): the same numbers,
    hence the same verdicts, as RoundRandomness gives after the verification."""
    from edge_node.server import DrawsAhead

    rng = np.random.default_rng(3)
    for r in range(40):
        ahead, later = DrawsAhead(7, "d0", r, 4), RoundRandomness(7, "d0", r)
        assert all(np.array_equal(ahead.acceptance_uniforms(n), later.acceptance_uniforms(n)) for n in range(7))
        assert ahead.final_uniform() == later.final_uniform()
        toks = rng.integers(0, 4, 4).tolist()
        q = rng.dirichlet(np.ones(4), 4)
        p = rng.dirichlet(np.ones(4), 5)
        for mode in ("UL", "DL"):
            assert verify_draft(p, q[np.arange(4), toks], q, toks, mode, ahead) == \
                verify_draft(p, q[np.arange(4), toks], q, toks, mode, later)
