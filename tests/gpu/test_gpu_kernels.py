"""The device kernels compiled for and run on a real GPU, against the host kernels and ml_dtypes: the checks
the simulator runs on the CPU (tests/device_sim_checks.py), now on the hardware's own arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

import gpu_common  # noqa: F401 - puts tests/ on sys.path
from gpu_common import unavailable

WHY = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

if WHY is None:
    from device_sim_checks import (assert_same, make, run, test_bad_input_is_a_clear_error,  # noqa: F401
                                   test_bfloat16_rounds_like_ml_dtypes_bit_for_bit, test_bfloat16_ties_go_to_even,
                                   test_integer_avg_truncates_toward_zero_even_at_int_min,
                                   test_integers_wrap_like_nccl, test_matches_host)


def test_grid_stride_loop_on_the_device():
    from ringcomm.kernels import device as D
    from ringcomm.kernels import host as H
    blocks, threads = D.launch_config(1 << 30)
    n = 3 * blocks * threads + 17               # three trips of the whole grid, and a ragged end
    for dt in (np.dtype(np.float32), D.BFLOAT16):
        a, b = make(dt, n, 3), make(dt, n, 4)
        with np.errstate(all="ignore"):
            want = H.reduce_copy(np.empty_like(a), a, b, "sum")
        assert_same(run(lambda o, x, y: D.reduce_copy(o, x, y, "sum"), np.zeros_like(a), a, b), want, "sum")
