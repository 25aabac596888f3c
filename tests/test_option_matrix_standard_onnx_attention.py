"""The option matrix's rows (tests/option_matrix.py) that attend through standard or onnx-attention, each exported from
a tiny random checkpoint and held to eager PyTorch; the matrix is split in two modules so that two workers share
it."""

import pytest
from option_matrix import check_row, rows_attending


@pytest.mark.parametrize(("index", "row"), rows_attending("standard", "onnx-attention"))
def test_the_row_exports_and_generates_what_eager_generates(tmp_path, index, row):
    check_row(row, tmp_path, seed=index)
