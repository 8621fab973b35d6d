"""compute_gae against references computed by hand (no loop mirroring the implementation)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.gae import compute_gae

# gamma * lambda = 0.5 * 0.8 = 0.4 throughout the main fragment test.
GAMMA = 0.5
LAM = 0.8


def _fragment():
    """T=4, N=2.

    env 0: terminates at t=1, a new episode starts at t=2 and runs past the fragment end.
    env 1: truncated (time limit) at t=2, a new episode starts at t=3 and runs past the end.
    """
    rewards = np.array(
        [[1.0, 0.0],
         [3.0, 1.0],
         [0.0, 2.0],
         [1.0, 1.0]], dtype=np.float32)
    values = np.array(
        [[1.0, 2.0],
         [2.0, 2.0],
         [4.0, 2.0],
         [2.0, 6.0]], dtype=np.float32)
    terminated = np.array(
        [[False, False],
         [True, False],
         [False, False],
         [False, False]])
    truncated = np.array(
        [[False, False],
         [False, False],
         [False, True],
         [False, False]])
    # Only final_values[2, 1] is meaningful (V of the final obs of env 1's truncated episode).
    # Everything else is garbage that must be ignored.
    final_values = np.array(
        [[100.0, 100.0],
         [100.0, 100.0],
         [100.0, 4.0],
         [100.0, 100.0]], dtype=np.float32)
    last_values = np.array([4.0, 2.0], dtype=np.float32)
    return rewards, values, terminated, truncated, final_values, last_values


# ---- hand-computed reference (gamma=0.5, lambda=0.8, gamma*lambda=0.4) ----
# env 0 (terminated at t=1):
#   t=3: delta = 1 + 0.5*4 (last_values) - 2 =  1      A3 =  1
#   t=2: delta = 0 + 0.5*2 (values[3])   - 4 = -3      A2 = -3 + 0.4*1 = -2.6
#   t=1: delta = 3 + 0.5*0 (terminated)  - 2 =  1      A1 =  1           (nothing from A2)
#   t=0: delta = 1 + 0.5*2 (values[1])   - 1 =  1      A0 =  1 + 0.4*1 = 1.4
# env 1 (truncated at t=2, final value 4):
#   t=3: delta = 1 + 0.5*2 (last_values) - 6 = -4      A3 = -4
#   t=2: delta = 2 + 0.5*4 (final_value) - 2 =  2      A2 =  2           (nothing from A3)
#   t=1: delta = 1 + 0.5*2 (values[2])   - 2 =  0      A1 =  0 + 0.4*2 = 0.8
#   t=0: delta = 0 + 0.5*2 (values[1])   - 2 = -1      A0 = -1 + 0.4*0.8 = -0.68
EXPECTED_ADV = np.array(
    [[1.0 + 0.4 * 1.0, -1.0 + 0.4 * 0.8],
     [1.0, 0.0 + 0.4 * 2.0],
     [-3.0 + 0.4 * 1.0, 2.0],
     [1.0, -4.0]])
# returns = advantages + values
EXPECTED_RET = np.array(
    [[1.4 + 1.0, -0.68 + 2.0],
     [1.0 + 2.0, 0.8 + 2.0],
     [-2.6 + 4.0, 2.0 + 2.0],
     [1.0 + 2.0, -4.0 + 6.0]])


def test_hand_computed_fragment_advantages_and_returns():
    adv, ret = compute_gae(*_fragment(), gamma=GAMMA, gae_lambda=LAM)
    np.testing.assert_allclose(adv, EXPECTED_ADV, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret, EXPECTED_RET, rtol=1e-6, atol=1e-6)


def test_output_dtype_and_shape():
    adv, ret = compute_gae(*_fragment(), gamma=GAMMA, gae_lambda=LAM)
    assert adv.shape == (4, 2) and ret.shape == (4, 2)
    assert adv.dtype == np.float32 and ret.dtype == np.float32


def test_output_dtype_float32_for_float64_inputs():
    r, v, te, tr, fv, lv = _fragment()
    adv, ret = compute_gae(r.astype(np.float64), v.astype(np.float64), te, tr, fv.astype(np.float64),
                           lv.astype(np.float64), GAMMA, LAM)
    assert adv.dtype == np.float32 and ret.dtype == np.float32
    np.testing.assert_allclose(adv, EXPECTED_ADV, rtol=1e-6, atol=1e-6)


def test_returns_equal_advantages_plus_values():
    r, v, te, tr, fv, lv = _fragment()
    adv, ret = compute_gae(r, v, te, tr, fv, lv, GAMMA, LAM)
    np.testing.assert_allclose(ret, adv + v, rtol=0, atol=1e-6)


def test_terminated_step_bootstraps_from_zero():
    adv, _ = compute_gae(*_fragment(), gamma=GAMMA, gae_lambda=LAM)
    # 3 + 0.5*0 - 2; bootstrapping from values[2]=4 would give 3 + 2 - 2 = 3,
    # from the garbage final_values[1,0]=100 would give 51.
    assert adv[1, 0] == pytest.approx(1.0, abs=1e-6)


def test_truncated_step_bootstraps_from_final_value_not_next_value():
    adv, _ = compute_gae(*_fragment(), gamma=GAMMA, gae_lambda=LAM)
    # 2 + 0.5*4 - 2 = 2; values[3,1]=6 would give 3, zero (treated as terminal) would give 0.
    assert adv[2, 1] == pytest.approx(2.0, abs=1e-6)


def test_final_value_changes_only_the_truncated_step_chain():
    r, v, te, tr, fv, lv = _fragment()
    adv_a, _ = compute_gae(r, v, te, tr, fv, lv, GAMMA, LAM)
    fv2 = fv.copy()
    fv2[2, 1] = 8.0  # +4 in V(final obs): delta at (2,1) grows by 0.5*4 = 2
    adv_b, _ = compute_gae(r, v, te, tr, fv2, lv, GAMMA, LAM)
    diff = adv_b - adv_a
    # env 1: t=2 +2, t=1 +0.4*2 = 0.8, t=0 +0.4*0.8 = 0.32, t=3 unaffected; env 0 unaffected.
    expected = np.array([[0.0, 0.32], [0.0, 0.8], [0.0, 2.0], [0.0, 0.0]])
    np.testing.assert_allclose(diff, expected, atol=1e-5)


def test_no_advantage_flows_back_across_episode_boundaries():
    r, v, te, tr, fv, lv = _fragment()
    adv_a, _ = compute_gae(r, v, te, tr, fv, lv, GAMMA, LAM)
    # Perturb the rewards strictly after each boundary (env 0: t>=2, env 1: t=3)...
    r2 = r.copy()
    r2[2:, 0] += 50.0
    r2[3, 1] += 50.0
    lv2 = lv + 50.0  # ...and the bootstrap after the fragment end.
    adv_b, _ = compute_gae(r2, v, te, tr, fv, lv2, GAMMA, LAM)
    # Steps at or before a boundary must not move at all.
    np.testing.assert_array_equal(adv_b[:2, 0], adv_a[:2, 0])
    np.testing.assert_array_equal(adv_b[:3, 1], adv_a[:3, 1])
    # ...while the steps after it do (so this test can see a leak).
    assert np.all(np.abs(adv_b[2:, 0] - adv_a[2:, 0]) > 1.0)
    assert abs(adv_b[3, 1] - adv_a[3, 1]) > 1.0


def test_last_step_bootstraps_from_last_values():
    r, v, te, tr, fv, lv = _fragment()
    adv, _ = compute_gae(r, v, te, tr, fv, lv, GAMMA, LAM)
    # env 0 t=3: 1 + 0.5*4 - 2 = 1; env 1 t=3: 1 + 0.5*2 - 6 = -4
    assert adv[3, 0] == pytest.approx(1.0, abs=1e-6)
    assert adv[3, 1] == pytest.approx(-4.0, abs=1e-6)
    adv2, _ = compute_gae(r, v, te, tr, fv, np.array([0.0, 10.0], dtype=np.float32), GAMMA, LAM)
    # env 0 t=3: 1 + 0 - 2 = -1; env 1 t=3: 1 + 5 - 6 = 0
    assert adv2[3, 0] == pytest.approx(-1.0, abs=1e-6)
    assert adv2[3, 1] == pytest.approx(0.0, abs=1e-6)


def test_terminated_and_truncated_same_step_termination_wins():
    # T=2, N=1; both flags set at t=0, a misleading final value of 10 there.
    rewards = np.array([[1.0], [1.0]], dtype=np.float32)
    values = np.array([[1.0], [1.0]], dtype=np.float32)
    terminated = np.array([[True], [False]])
    truncated = np.array([[True], [False]])
    final_values = np.array([[10.0], [0.0]], dtype=np.float32)
    last_values = np.array([2.0], dtype=np.float32)
    adv, ret = compute_gae(rewards, values, terminated, truncated, final_values, last_values, 0.5, 0.8)
    # t=1: delta = 1 + 0.5*2 - 1 = 1                  A1 = 1
    # t=0: delta = 1 + 0 (termination wins) - 1 = 0    A0 = 0  (not 1 + 0.5*10 - 1 = 5, no leak of A1)
    np.testing.assert_allclose(adv, np.array([[0.0], [1.0]]), atol=1e-6)
    np.testing.assert_allclose(ret, np.array([[1.0], [2.0]]), atol=1e-6)


def test_lambda_one_gamma_one_is_monte_carlo_return_minus_value():
    # env 0: one episode that terminates at t=3.  env 1: no boundary, bootstraps V(s_T)=5.
    rewards = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]], dtype=np.float32)
    values = np.array([[0.5, 2.0], [1.0, 2.0], [2.0, 2.0], [3.0, 2.0]], dtype=np.float32)
    terminated = np.array([[False, False], [False, False], [False, False], [True, False]])
    truncated = np.zeros((4, 2), dtype=bool)
    final_values = np.zeros((4, 2), dtype=np.float32)
    last_values = np.array([99.0, 5.0], dtype=np.float32)  # env 0's 99 must be ignored (terminated)
    adv, ret = compute_gae(rewards, values, terminated, truncated, final_values, last_values, 1.0, 1.0)
    # env 0 MC returns: G3 = 4, G2 = 3+4 = 7, G1 = 2+7 = 9, G0 = 1+9 = 10
    # env 1 MC returns: G3 = 1+5 = 6, G2 = 7, G1 = 8, G0 = 9
    mc = np.array([[10.0, 9.0], [9.0, 8.0], [7.0, 7.0], [4.0, 6.0]])
    np.testing.assert_allclose(ret, mc, atol=1e-5)
    # advantages = G - V: env 0: 10-0.5, 9-1, 7-2, 4-3; env 1: 9-2, 8-2, 7-2, 6-2
    np.testing.assert_allclose(adv, np.array([[9.5, 7.0], [8.0, 6.0], [5.0, 5.0], [1.0, 4.0]]), atol=1e-5)
