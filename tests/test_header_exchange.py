"""The two-level header exchange's pure functions: the summary, rank 0's table index, the blocks."""

from __future__ import annotations

import numpy as np
import pytest

from distcomm._wire import frame as _frame


@pytest.mark.parametrize("odd", [[], [0], [1], [5], [6], [0, 1], [2, 4], [0, 6]])
def test_header_summary_names_the_one_odd_slot_or_asks_for_the_table(odd: list[int]) -> None:
    from distcomm._transfer.header_exchange import summarize

    world, size = 7, _frame.HEADER_SLOT
    table = bytearray(b"c" * size * world)
    for r in odd:
        table[r * size : (r + 1) * size] = bytes([r]) * size
    out = memoryview(bytearray(8 + 2 * size))
    summarize(memoryview(table), world, size, out)
    word = int.from_bytes(out[:8], "little", signed=True)
    if len(odd) > 1:
        assert word == -1
    else:
        assert word == (odd[0] + 1 if odd else 0) and bytes(out[8 : 8 + size]) == b"c" * size
        if odd:
            assert bytes(out[8 + size :]) == bytes([odd[0]]) * size


@pytest.mark.parametrize("blocks", [
    [[0, 1], [2, 3], [4, 5]],  # consecutive, in order, all of one length: the tables are the table
    [[0], [1, 2, 3], [4, 5]],  # rank 0 alone, then runs (hosts of one rank)
    [[0, 1], [2], [3, 4, 5]],  # uneven machines
    [[0, 2, 4], [1, 3, 5]],  # machines whose ranks interleave
    [[0, 1, 2], [3, 4]],  # a shorter last block
])
def test_rank_0_assembles_the_table_from_the_blocks_tables(blocks: list[list[int]]) -> None:
    """Rank 0 gets each block's slots from its first rank in one buffer per block (as long as the
    longest block); the table it makes of them holds every rank's slot in its row, in one pass."""
    from distcomm._transfer.header_exchange import table_index

    world, size = sum(len(b) for b in blocks), 8
    per = max(len(b) for b in blocks)
    tables = np.zeros((len(blocks), per, size), dtype=np.uint8)
    for i, b in enumerate(blocks):
        for j, r in enumerate(b):
            tables[i, j] = r + 1
    index = table_index(blocks, world)
    table = tables.reshape(-1, size)[: world] if index is None else np.take(tables.reshape(-1, size), index, axis=0)
    assert (index is None) == (blocks == [[0, 1], [2, 3], [4, 5]])
    assert table.tolist() == [[r + 1] * size for r in range(world)]


def test_rank_0_takes_the_tables_of_machines_of_8_in_place() -> None:
    """At 1,024 ranks on machines of 8 the blocks' tables land in rank 0's table as they are (no
    copy); on hosts of one rank it takes them in one pass over a precomputed index."""
    from distcomm._transfer.header_exchange import header_blocks, table_index

    machines = [list(range(m, m + 8)) for m in range(0, 1024, 8)]
    assert table_index(header_blocks(1024, machines), 1024) is None
    index = table_index(header_blocks(1024, [[r] for r in range(1024)]), 1024)
    assert index is not None and index[0] == 0 and index[1] == 32 and index[1023] == 32 * 32 + 30


@pytest.mark.parametrize(("world", "machines", "blocks"), [
    (4, [[0, 1, 2, 3]], [[0, 1, 2, 3]]),  # small worlds: one block (set-up; the slots go all to all)
    (16, [list(range(16))], [list(range(16))]),  # one machine: one block
    # hosts of one rank, up to FLAT_WORLD: one block (a gather on rank 0, a broadcast)
    (16, [[r] for r in range(16)], [list(range(16))]),
    (32, [[r] for r in range(32)], [list(range(32))]),
    (5, [[r] for r in range(5)], [[0, 1, 2, 3, 4]]),
    # beyond: rank 0 alone, the others in runs of ceil(sqrt(world - 1))
    (33, [[r] for r in range(33)], [[0]] + [list(range(i, min(i + 6, 33))) for i in range(1, 33, 6)]),
    (24, [list(range(0, 24, 2)), list(range(1, 24, 2))], [list(range(0, 24, 2)), list(range(1, 24, 2))]),
    (12, [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10, 11]], [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]),
    (130, [list(range(65)), list(range(65, 130))],
     [[0]] + [list(range(i, min(i + 12, 130))) for i in range(1, 130, 12)]),
])
def test_header_blocks_follow_the_machines_else_one_block_then_sqrt_runs(world: int, machines: list[list[int]],
                                                          blocks: list[list[int]]) -> None:
    from distcomm._transfer.header_exchange import header_blocks

    assert header_blocks(world, machines) == blocks


def test_header_blocks_at_1024_ranks() -> None:
    """Machines of 8 GPUs: 128 blocks of 8 (rank 0 gathers 7 slots, then 127 tables); hosts of one
    rank: rank 0 alone, then 31 blocks of 32 and one of 31 (rank 0 gathers 32 tables, nothing else)."""
    from distcomm._transfer.header_exchange import header_blocks

    machines = [list(range(m, m + 8)) for m in range(0, 1024, 8)]
    assert header_blocks(1024, machines) == machines
    assert header_blocks(1024, [[r] for r in range(1024)]) == [[0]] + [list(range(m, min(m + 32, 1024)))
                                                                        for m in range(1, 1024, 32)]
