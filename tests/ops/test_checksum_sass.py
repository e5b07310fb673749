"""The block sums' sm_90 SASS in the built extension (tools/checksum_sass.py): where C's rows are
contiguous, a thread reads four elements of a row a load and a warp reduces a row's sums once per
128 elements, so that a row costs a quarter of the shuffles and about half the instructions an
element of the column-a-thread walk, with no spilled register in the loop; and the products
kernels' instructions an entry."""

import subprocess

import pytest

from bench import checksum_sass as tool


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


def test_a_row_reduces_its_four_sums_in_ten_shuffles_or_through_shared_memory():
    """Where a thread walks a column, a row's four sums meet across the warp by a reduce-scatter
    and a gather, 10 shuffles where a butterfly of each sum takes 20 (abft_cuda.cu, warp_sums):
    a load reads one element of a row, and a loop shuffles at most 10 times a load. Where rows
    are read in vectors, the lanes' shares of a quad of rows' sums meet in shared memory
    (QuadStage): a loop of four rows, four loads, makes one shuffle, 16 stores of the shares and
    one of the totals, and reads them in four 16-byte loads."""
    found = built_report()
    for kind in ("screened", "plain", "paired"):
        loops = [loop for loop in found[f"{kind}, a column a thread"]["loops"] if loop["shuffles"]]
        assert loops, kind
        assert all(loop["shuffles"] <= 10 * len(loop["loads"]) for loop in loops), kind
        for loop in found[f"{kind}, rows in vectors"]["loops"]:
            assert len(loop["loads"]) == 4 and loop["shuffles"] == 1, (kind, loop)
            assert loop["shared"] == {"LDS.128": 4, "STS": 17}, (kind, loop)


def test_rows_in_vectors_take_at_most_16_instructions_an_element():
    """Four elements of a row a load, eight sums an element (a row's and a column's plain,
    weighted, magnitude and weighted magnitude): at most 16 instructions an element of C in the
    loop, where the reduction by shuffles took 24.4 (195 for two rows)."""
    found = built_report()
    for kind in ("screened", "plain", "paired"):
        for loop in found[f"{kind}, rows in vectors"]["loops"]:
            assert per_element(loop, 4)[0] <= 16, (kind, loop)


def test_rows_in_vectors_are_loaded_rows_ahead_of_their_sums():
    """The vector walk keeps four rows' loads in flight (four buffers, each reloaded with the row
    four on once its row is summed): a load's first use is rows of work later, not the next few
    instructions, so that other warps' work and the warp's own other loads cover its latency
    (before the prefetch, the loop used each load 6 to 9 instructions after it, one load a warp
    in flight)."""
    found = built_report()
    for kind in ("screened", "plain", "paired"):
        for loop in found[f"{kind}, rows in vectors"]["loops"]:
            assert loop["load_to_use"]["LDG.E.64"] >= 64, (kind, loop)


def test_a_pass_of_two_loads_its_row_an_iteration_ahead():
    """The products of few vectors (the attention's operands) load a row's entries an
    iteration ahead of their products, as the block sums do: a load's first use an iteration's
    work later (it was 24 to 32 instructions)."""
    (loop,) = [
        loop
        for loop in built_report()["products, a pass of two"]["loops"]
        if "LDG.E.64" in loop["loads"]
    ]
    assert loop["load_to_use"]["LDG.E.64"] >= 64, loop


def test_products_of_few_vectors_issue_few_instructions_an_element():
    """A pass of two vectors (the attention's operands) holds no spilled register and reads a row
    four entries a load in at most 16 instructions an entry (the kernel that held sixteen
    vectors for every pass took 770); a pass of sixteen (a projection's blocks) reads a row in
    vectors in under a quarter of the instructions an entry of its one-entry walk."""
    found = built_report()
    few, wide = found["products, a pass of two"], found["products, a pass of sixteen"]
    assert few["stack_bytes"] == 0
    for kind in (few, wide):
        vectors = [loop for loop in kind["loops"] if "LDG.E.64" in loop["loads"]]
        entries = [loop for loop in kind["loops"] if "LDG.E.U16" in loop["loads"]]
        assert len(vectors) == 1 and len(entries) == 2
        assert all(loop["local"] == 0 for loop in kind["loops"])
        assert set(vectors[0]["loads"]) == {"LDG.E.64", "LDG.E.128"}
    vector = [loop for loop in few["loops"] if "LDG.E.64" in loop["loads"]][0]
    assert vector["instructions"] / (4 * vector["loads"].count("LDG.E.64")) <= 16
    wide_vector = [loop for loop in wide["loops"] if "LDG.E.64" in loop["loads"]][0]
    wide_entry = min(
        loop["instructions"] / loop["loads"].count("LDG.E.U16")
        for loop in wide["loops"]
        if "LDG.E.U16" in loop["loads"]
    )
    assert wide_vector["instructions"] / 4 <= wide_entry / 4


def test_a_wide_pass_reads_two_rows_a_warp_on_half_the_vector_loads():
    """Where every operand of a launch reads its rows in vectors (a projection's), a pass of
    sixteen reads two rows a warp: each load of the vectors serves both, so an entry of A takes
    half the vector loads and under 70% of the instructions of the one-row walk, with no spill
    (its 128 registers: two thread blocks an SM)."""
    found = built_report()
    one = found["products, a pass of sixteen"]
    two = found["products, a pass of sixteen, two rows a warp"]
    assert two["stack_bytes"] == 0
    (pairs,) = two["loops"]
    (single,) = [loop for loop in one["loops"] if "LDG.E.64" in loop["loads"]]
    assert pairs["local"] == 0
    assert pairs["loads"].count("LDG.E.64") == 2  # four entries of each row
    entries, single_entries = 8, 4 * single["loads"].count("LDG.E.64")
    vectors = pairs["loads"].count("LDG.E.128") / entries
    assert vectors <= single["loads"].count("LDG.E.128") / single_entries / 2
    assert pairs["instructions"] / entries <= 0.7 * single["instructions"] / single_entries
