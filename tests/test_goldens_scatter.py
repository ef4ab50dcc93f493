"""scatter_req_token_ids worked by hand from docs/format.md §9.5, through the ``ops`` fixture."""

import numpy as np

from tests.support.goldens import arr


def test_scatter_basic(ops):
    p = ops.scatter_req_token_ids(arr(np.full((4, 4), -7)), arr([10, 11, 12, 20, 21, 22, 23, 24, 30]),
                                  arr([0, 3, 8, 9, 9]), arr([1, 2, 1, 0]))
    # row 1: first [10,11,12], then r=2 rewrites cell 0 with 30; row 2 truncated to 4 ids
    assert np.asarray(p).tolist() == [[-7, -7, -7, -7], [30, 11, 12, -7], [20, 21, 22, 23],
                                      [-7, -7, -7, -7]]
    assert np.asarray(p).dtype == np.int32
