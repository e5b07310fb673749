"""The block sums' sm_90 SASS in the built extension (tools/checksum_sass.py): where C's rows are
contiguous, a thread reads four elements of a row a load, else an element of its column; on both
paths a quad of rows' sums meets in shared memory, with one shuffle and no spilled register in
the loop; the products kernels' instructions an entry; and the fused softmax's row of S read once
into registers."""

import functools
import subprocess

import pytest

from bench import checksum_sass as tool


@functools.cache  # a dump of the extension takes seconds: each report is made once
def built(report=tool.report):
    """``report`` (tool.report, or tool.softmax_report) of the built extension, in bf16."""
    binary = tool.extension()
    if binary is None:
        pytest.skip("no built extension")
    try:
        return report(binary, "bf16")
    except subprocess.CalledProcessError:
        pytest.skip("the built extension holds no sm_90 code (a CPU-only build)")


def per_element(loop, elements_a_load):
    """A loop's instructions a lane's element, its loads reading ``elements_a_load`` each."""
    return loop["instructions"] / (len(loop["loads"]) * elements_a_load)


def test_both_walks_meet_a_quads_row_sums_in_shared_memory():
    """A row's four sums are spread over a warp's lanes on both paths (rows in vectors: four
    elements of a row a lane, one load; a column a thread: one element a lane). They meet in
    shared memory four rows at a time (cuda_block_sums.cuh, QuadStage): each loop over a quad
    of rows makes one shuffle, 16 stores of the lanes' shares and one of the totals, and reads
    them in four 16-byte loads, where a reduction by shuffles took 10 a row; no spilled
    register in a loop."""
    found = built()
    for kind in ("screened", "plain", "paired"):
        vectors = found[f"{kind}, rows in vectors"]["loops"]
        columns = found[f"{kind}, a column a thread"]["loops"]
        assert vectors and columns, kind
        assert all(set(loop["loads"]) == {"LDG.E.64"} for loop in vectors), kind
        assert all(set(loop["loads"]) == {"LDG.E.U16"} for loop in columns), kind
        for loop in vectors + columns:
            assert loop["local"] == 0 and loop["shuffles"] == 1, (kind, loop)
            assert loop["shared"] == {"LDS.128": 4, "STS": 17}, (kind, loop)


def test_a_quad_of_rows_takes_fewer_instructions_than_its_shuffles_did():
    """Eight sums an element (a row's and a column's plain, weighted, magnitude and weighted
    magnitude). Rows in vectors: at most 16 instructions a lane's element (four a load), where
    the reduction by shuffles took 24.4 (195 for two rows). A column a thread: a quad of rows in
    at most 190 instructions where the rows' sums are screened or plain (the loop holds two
    copies of a quad's loads, as ptxas built it), 128 in an encode's paired launch, where four
    rows took 239 to 247 (with 40 shuffles)."""
    found = built()
    for kind in ("screened", "plain", "paired"):
        for loop in found[f"{kind}, rows in vectors"]["loops"]:
            assert len(loop["loads"]) == 4 and per_element(loop, 4) <= 16, (kind, loop)
        for loop in found[f"{kind}, a column a thread"]["loops"]:
            assert loop["instructions"] <= (128 if kind == "paired" else 190), (kind, loop)


def test_a_screen_finds_its_matrix_once_a_tile():
    """A screened tile's screens read the tile's matrix of each side from shared memory, found
    once a tile (cuda_block_sums.cuh, start_screens): the loops around a screened walk's
    reading loop call no more (int64 divisions) than the plain walk's, where each screened
    vector found its matrix's batch offsets anew (43 and 44 calls around the loop)."""
    found = built()
    for walk in ("rows in vectors", "a column a thread"):
        screened = found[f"screened, {walk}"]
        plain = found[f"plain, {walk}"]
        most = max(loop["calls_around"] for loop in plain["loops"])
        assert all(loop["calls_around"] <= most for loop in screened["loops"]), (walk, screened)


def test_rows_in_vectors_are_loaded_rows_ahead_of_their_sums():
    """The vector walk keeps four rows' loads in flight (four buffers, each reloaded with the row
    four on once its row is summed): a load's first use is rows of work later, not the next few
    instructions, so that other warps' work and the warp's own other loads cover its latency
    (before the prefetch, the loop used each load 6 to 9 instructions after it, one load a warp
    in flight)."""
    found = built()
    for kind in ("screened", "plain", "paired"):
        for loop in found[f"{kind}, rows in vectors"]["loops"]:
            assert loop["load_to_use"]["LDG.E.64"] >= 64, (kind, loop)


def test_a_pass_of_two_loads_its_row_an_iteration_ahead():
    """The products of few vectors (the attention's operands) load a row's entries an
    iteration ahead of their products, as the block sums do: a load's first use an iteration's
    work later (it was 24 to 32 instructions)."""
    (loop,) = [
        loop for loop in built()["products, a pass of two"]["loops"] if "LDG.E.64" in loop["loads"]
    ]
    assert loop["load_to_use"]["LDG.E.64"] >= 64, loop


def test_products_of_few_vectors_issue_few_instructions_an_element():
    """A pass of two vectors (the attention's operands) holds no spilled register and reads a row
    four entries a load in at most 16 instructions an entry (the kernel that held sixteen
    vectors for every pass took 770); a pass of sixteen (a projection's blocks) reads a row in
    vectors in under a quarter of the instructions an entry of its one-entry walk."""
    found = built()
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
    found = built()
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


def test_the_fused_softmax_reads_a_row_of_s_once_into_registers():
    """The fused softmax's kernel for rows that fit a warp's registers (bf16: 2048 columns, 16
    vectors of 4 a lane) loads a row of S once, a vector a load, and keeps it in 128 registers
    with no spill (two thread blocks an SM) for its three passes, where the general kernel
    reads it five times, an element a load; it writes P a vector a store. Its row's code has no
    loop that runs twice, so its length bounds the instructions a row takes: at most 102 a
    lane's element, where the general kernel's three passes alone take 138 (160, 188 and 204 for
    four elements)."""
    found = built(tool.softmax_report)
    rows, general = found["rows in registers"], found["any rows"]
    assert rows["registers"] <= 128 and rows["stack_bytes"] == 0
    row = rows["row"]
    assert row["loads"]["LDG.E.64"] == 16 and row["local"] == 0
    assert not any(op.endswith("U16") for op in (*row["loads"], *row["stores"]))
    assert "STG.E.64" in row["stores"]
    assert row["instructions"] / 64 <= 102
    passes = [loop for loop in general["loops"] if loop["loads"].count("LDG.E.U16") == 4]
    assert sum(loop["instructions"] for loop in passes) / 4 >= 138


def test_the_fused_softmax_adds_a_groups_columns_a_vector_a_load():
    """After each group of rows, a thread adds the group's 8 rows of S, then of P, to the band's
    column sums of its 4 columns: 8 vector loads issued before the first is used, the sums read
    and written in 16-byte shared memory accesses, at most 9 instructions an element."""
    (loop,) = built(tool.softmax_report)["rows in registers"]["loops"]
    assert loop["loads"] == ["LDG.E.64"] * 8 and loop["local"] == 0
    assert loop["shared"] == {"LDS.128": 4, "STS.128": 4}
    assert loop["instructions"] / 32 <= 9
