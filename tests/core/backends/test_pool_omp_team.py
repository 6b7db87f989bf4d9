"""Big C jobs on torch's OpenMP team or on atb's own pool (``use_omp_team``; atb_paddle
and atb_mindspore turn the team off): the same results bit for bit, and with it off
no job goes to the team."""

import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.bindings import pool_stats, use_omp_team

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")


def test_big_matmuls_equal_on_team_and_pool_and_off_means_off():
    import atb_torch as atb

    g = torch.Generator().manual_seed(0)
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=344), atb.SiLU(),
                       atb.Linear(out_features=136), atb.ResidualAdd()])
    x = torch.randn(1, 128, 136, generator=g)
    was = use_omp_team(True)
    try:
        with torch.no_grad():
            on = mlp(x)
            use_omp_team(False)
            before = pool_stats()["team_jobs"]
            off = mlp(x)
            assert pool_stats()["team_jobs"] == before
        assert torch.equal(on, off)
        assert use_omp_team(was) is False  # the previous setting comes back
    finally:
        use_omp_team(was)
