"""The block sums' sm_90 SASS in the built extension (tools/checksum_sass.py): where C's rows are
contiguous, a thread reads four elements of a row a load and a warp reduces a row's sums once per
128 elements, so that a row costs a quarter of the shuffles and about half the instructions an
element of the column-a-thread walk, with no spilled register in the loop."""

import subprocess

import pytest

from tools import checksum_sass as tool


def built_report():
    binary = tool.extension()
    if binary is None:
        pytest.skip("no built extension")
    try:
        return tool.report(binary, "bf16")
    except subprocess.CalledProcessError:
        pytest.skip("the built extension holds no sm_90 code (a CPU-only build)")


def per_element(loop, elements_a_load):
    elements = len(loop["loads"]) * elements_a_load
    return loop["instructions"] / elements, loop["shuffles"] / elements


def test_rows_in_vectors_shuffle_a_quarter_as_often_as_a_column_a_thread():
    found = built_report()
    for kind in ("screened", "plain", "paired"):
        vectors = found[f"{kind}, rows in vectors"]["loops"]
        columns = found[f"{kind}, a column a thread"]["loops"]
        assert vectors and columns, kind
        assert all(set(loop["loads"]) == {"LDG.E.64"} for loop in vectors), kind
        assert all(set(loop["loads"]) == {"LDG.E.U16"} for loop in columns), kind
        assert all(loop["local"] == 0 for loop in vectors + columns), kind
        # the loops that reduce rows (those with shuffles), both paths
        v = max(per_element(loop, 4) for loop in vectors if loop["shuffles"])
        c = min(per_element(loop, 1) for loop in columns if loop["shuffles"])
        assert v[1] <= c[1] / 4, (kind, v, c)
        assert v[0] <= c[0] / 2, (kind, v, c)
