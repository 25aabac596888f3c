"""The option matrix's rows (tests/option_matrix.py) that attend through standard or onnx-attention, each exported from
a tiny random checkpoint and held to eager PyTorch; the matrix is split in two modules so that two workers share
it."""

import pytest
from option_matrix import ROWS, check_row, row_id

from exporters.native.library import available

HALF = [(index, row) for index, row in enumerate(ROWS) if row["attention"] in ("standard", "onnx-attention")]


@pytest.mark.parametrize(("index", "row"), HALF, ids=[f"{index}-{row_id(row)}" for index, row in HALF])
def test_the_row_exports_and_generates_what_eager_generates(tmp_path, index, row):
    if row["attention"] == "fused" and available() is None:
        pytest.skip("the fused attention library cannot be built here")
    check_row(row, tmp_path, seed=index)
