"""Outputs do not follow the machine's load (issue 16): the batch size does not follow the
memory free at the moment."""

from __future__ import annotations

from types import SimpleNamespace

import torch



def test_batch_size_does_not_follow_free_memory(monkeypatch):
    """The batch size is fitted to the machine's memory, not to what other processes leave
    free at the moment; memory short now is a warning, not a smaller batch."""
    import psutil

    from specbatch.pipeline import fit_batch_size

    forward = SimpleNamespace(device=torch.device("cpu"), kv_bytes_per_token=24 * 1024,
                              hf_model=torch.nn.Linear(4, 4))
    per_row = 512 * 24 * 1024
    sizes = {}
    for available in (64 << 30, 3 * per_row):  # a quiet machine; one loaded by other jobs
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda a=available: SimpleNamespace(total=64 << 30, available=a))
        sizes[available] = fit_batch_size(16, 300, [forward])
    assert sizes[64 << 30] == (16, None)
    rows, note = sizes[3 * per_row]
    assert rows == 16 and note.startswith("warning: memory:") and "stays 16" in note
    # a machine that is too small for the rows still gets a smaller batch (from its total)
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=5 * per_row, available=5 * per_row))
    rows, note = fit_batch_size(16, 300, [forward])
    assert rows == 4 and "lowered from 16 to 4" in note
