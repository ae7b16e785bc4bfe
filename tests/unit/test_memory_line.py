"""``pipeline.memory_summary``: the run's one memory line."""

from __future__ import annotations

import pytest

from specbatch.pipeline import memory_summary
from tests.helpers import make_engine, tiny_llama


@pytest.mark.parametrize("rows,want", [(1, "(1 row x 256 positions)"),
                                       (3, "(3 rows x 256 positions)")])
def test_memory_line_counts_its_rows(rows, want):
    engine = make_engine(tiny_llama(48, seed=11), 0, rows)
    line = memory_summary(engine)
    assert line.startswith("memory: target weights ") and want in line, line
