"""kernels.sample_accept: the fused kernel gives the same ids and accepted counts as the engine's
torch path (``sampler.sample`` + ``sampler.count_accepted``), exactly."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels.sample_accept import sample_accept, sample_accept_reference, top_k_top_p_cut
from specbatch.spec_decode.sampler import mask_top_k_top_p


def _step(gen, num_fed, vocab, device, logits_dtype=torch.float32, scale=3.0):
    """A random step: the fed positions' logits [T, V] (row order, as ``runner.verify`` gives
    them) with exact ties planted, per-token parameters mixing greedy / T > 0 / top-k / top-p
    rows, and drafts that follow the reference's own targets for a while, then diverge."""
    bsz = len(num_fed)
    logits = (torch.randn(sum(num_fed), vocab, generator=gen) * scale).to(logits_dtype)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # greedy tie: id 3 must win
    cu = torch.tensor([0, *torch.tensor(num_fed).cumsum(0).tolist()])
    t = int(cu[-1])
    temp = torch.tensor([[0.0, 0.7, 1.0, 1.3][(i * 7) % 4] for i in range(t)], dtype=torch.float64)
    temp[0] = 0.0
    top_k = torch.tensor([[0, 0, 40, 1][(i * 5) % 4] for i in range(t)])
    top_p = torch.tensor([[1.0, 0.9, 1.0, 0.5][(i * 3) % 4] for i in range(t)],
                         dtype=torch.float64)
    seeds = torch.randint(-2**62, 2**62, (t,), generator=gen)
    positions = torch.randint(0, 5000, (t,), generator=gen)
    k = max(1, max(num_fed) - 1)
    draft = torch.full((bsz, k), -1)
    num_draft = torch.tensor([n - 1 for n in num_fed])
    args = [logits, cu, draft, num_draft, temp, top_k, top_p, seeds, positions]
    args = [a.to(device) for a in args]
    target, _ = sample_accept_reference(*args)
    for b, n in enumerate(num_fed):  # row b's drafts match its first b % n targets
        keep = b % max(n, 1)
        d = target[b, :n - 1].clone()
        d[keep:] = (d[keep:] + 1) % vocab
        args[2][b, :n - 1] = d
    return args


@pytest.mark.parametrize("vocab, logits_dtype, num_fed", [
    (3000, torch.float32, [6, 1, 3, 6, 2, 1, 4, 5]),  # 8 rows, k up to 5, rows with no drafts
    (49152, torch.float32, [3, 1]),  # SmolLM2's vocabulary (kept small: the interpreter is slow)
    (1500, torch.float64, [2, 4, 1])])
def test_sample_accept_equals_torch_path(device, vocab, logits_dtype, num_fed):
    gen = torch.Generator().manual_seed(vocab)
    args = _step(gen, num_fed, vocab, device, logits_dtype)
    qlen = max(num_fed) + 1  # one padded query more than the longest row
    want_ids, want_acc = sample_accept_reference(*args, query_len=qlen)
    got_ids, got_acc = sample_accept(*args, query_len=qlen)
    assert got_ids.shape == (len(num_fed), qlen)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_acc, want_acc)
    assert want_acc.tolist() == [b % n if n > 1 else 0 for b, n in enumerate(num_fed)]
    assert int(want_ids[0, 0]) == 3  # the planted tie went to the lower id
    # the T > 0 tokens really are random draws: not all the argmax
    greedy = args[0].argmax(-1)  # [T]: the fed slots of the grid, in row order
    assert (want_ids[want_ids >= 0] != greedy).any()


def test_bans_and_all_greedy_without_top_k_p(device):
    gen = torch.Generator().manual_seed(9)
    args = _step(gen, [3, 3, 2], 800, device)
    logits = args[0]
    t = int(args[1][-1])
    banned = torch.zeros(t, 800, dtype=torch.bool, device=device)
    want0, _ = sample_accept_reference(*args)
    banned[0, int(want0[0, 0])] = True  # ban the token the first position would take
    banned[:, 5] = True
    got = sample_accept(*args, banned=banned)
    want = sample_accept_reference(*args, banned=banned)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[0][0, 0]) != int(want0[0, 0])
    args[4].zero_()  # all greedy, no top-k / top-p: the kernel skips the threshold pre-pass
    args[5].zero_()
    args[6].fill_(1.0)
    got = sample_accept(*args, any_top_k_p=False)
    want = sample_accept_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0][want[0] >= 0], logits.argmax(-1))


def test_top_k_top_p_cut_is_the_masks_kept_set(device):
    gen = torch.Generator().manual_seed(4)
    scaled = torch.randn(12, 300, generator=gen, dtype=torch.float64).to(device)
    scaled[:, 10:20] = scaled[:, 10:11]  # ties at whatever rank the cut lands
    scaled[3, 50] = float("-inf")
    top_k = torch.tensor([0, 1, 5, 15, 0, 0, 40, 299, 300, 0, 3, 12], device=device)
    top_p = torch.tensor([0.5, 1, 1, 1, 0.1, 0.99, 0.8, 1, 1, 1e-9, 0.3, 0.7],
                         dtype=torch.float64, device=device)
    thr, cut = top_k_top_p_cut(scaled, top_k, top_p)
    ids = torch.arange(300, device=device)[None, :]
    kept = (scaled > thr[:, None]) | ((scaled == thr[:, None]) & (ids <= cut[:, None]))
    want = mask_top_k_top_p(scaled, top_k, top_p) > float("-inf")
    assert torch.equal(kept & (scaled > float("-inf")), want)
    assert want.sum(1).tolist()[1:4] == [1, 5, 15]


def test_sample_accept_checks_its_arguments(device):
    gen = torch.Generator().manual_seed(0)
    args = _step(gen, [2, 2], 100, device)
    with pytest.raises(ValueError, match="logits: float32 or float64"):
        sample_accept(args[0].half(), *args[1:])
    with pytest.raises(ValueError, match=r"logits: \[4, V\]"):  # a row per fed position
        sample_accept(args[0][:3], *args[1:])
    with pytest.raises(ValueError, match=r"cu_num_fed: \[3\]"):
        sample_accept(args[0], args[1][:2], *args[2:])
    with pytest.raises(ValueError, match="temperature: torch.float64"):
        sample_accept(*args[:4], args[4].float(), *args[5:])
    with pytest.raises(ValueError, match="banned"):
        sample_accept(*args, banned=torch.zeros(4, 99, dtype=torch.bool, device=device))
