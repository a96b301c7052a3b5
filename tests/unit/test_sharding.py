"""Parameter sharding over PS: pure tensor code, no processes."""

from __future__ import annotations

import pytest
import torch

from scaletrain.ps.sharding import Segment, gather, make_layout, scatter_


@pytest.fixture(scope="module")
def resnet50_numels() -> list[int]:
    from scaletrain.models.resnet import resnet

    return [p.numel() for p in resnet("resnet50", 1200).parameters()]


def assert_partition(numels: list[int], layout) -> None:
    """Every element of every tensor lies in exactly one segment."""
    by_param: dict[int, list[Segment]] = {}
    for shard in layout.shards:
        for s in shard:
            assert 0 <= s.lo < s.hi or s.lo == s.hi == 0
            by_param.setdefault(s.param, []).append(s)
    for i, n in enumerate(numels):
        segs = sorted(by_param.get(i, []), key=lambda s: s.lo)
        pos = 0
        for s in segs:
            assert s.lo == pos
            pos = s.hi
        assert pos == n
    assert sum(layout.numel(k) for k in range(layout.num_shards)) == sum(numels)


@pytest.mark.parametrize("p", range(1, 17))
def test_balanced_resnet50(resnet50_numels, p):
    layout = make_layout(resnet50_numels, p, "balanced")
    assert layout.num_shards == p
    assert layout.balance() <= 1.05
    sizes = [layout.numel(k) for k in range(p)]
    assert max(sizes) - min(sizes) <= 1
    assert layout.bytes(0) == 4 * sizes[0] and layout.bytes(0, itemsize=2) == 2 * sizes[0]
    assert_partition(resnet50_numels, layout)


@pytest.mark.parametrize("p", [1, 2, 3, 7, 16])
def test_round_robin_resnet50_whole_tensors(resnet50_numels, p):
    layout = make_layout(resnet50_numels, p, "round-robin")
    for k, shard in enumerate(layout.shards):
        for s in shard:
            assert s.param % p == k and s.lo == 0 and s.hi == resnet50_numels[s.param]
    assert_partition(resnet50_numels, layout)


def test_round_robin_is_unbalanced_at_16(resnet50_numels):
    rr = make_layout(resnet50_numels, 16, "round-robin").balance()
    bal = make_layout(resnet50_numels, 16, "balanced").balance()
    print(f"ResNet-50/1200 at 16 PS: round-robin max/mean {rr:.2f}, balanced {bal:.4f}")
    assert rr > 1.05 and bal <= 1.05


def test_layout_errors():
    with pytest.raises(ValueError, match=r"num_shards = 0: must be in \[1, 10\]"):
        make_layout([4, 6], 0, "balanced")
    with pytest.raises(ValueError, match=r"num_shards = 11: must be in \[1, 10\]"):
        make_layout([4, 6], 11, "round-robin")
    with pytest.raises(ValueError, match=r"sharding method 'greedy': choose one of balanced, round-robin"):
        make_layout([4, 6], 2, "greedy")


def test_balanced_splits_tensors():
    layout = make_layout([10, 2], 3, "balanced")
    assert layout.shards == ((Segment(0, 0, 4),), (Segment(0, 4, 8),), (Segment(0, 8, 10), Segment(1, 0, 2)))


@pytest.mark.parametrize("method", ["balanced", "round-robin"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_gather_scatter_round_trip(method, p):
    g = torch.Generator().manual_seed(p)
    shapes = [(3, 4), (7,), (2, 3, 5), (1,), (6, 2)]
    tensors = [torch.randn(*s, generator=g) for s in shapes]
    layout = make_layout([t.numel() for t in tensors], p, method)
    flats = [gather(tensors, shard) for shard in layout.shards]
    assert [f.numel() for f in flats] == [layout.numel(k) for k in range(p)]
    assert torch.equal(torch.cat([f for f in flats]).sort().values,
                       torch.cat([t.reshape(-1) for t in tensors]).sort().values)
    targets = [torch.randn(*s, generator=g) for s in shapes]
    for shard in layout.shards:
        scatter_(tensors, shard, gather(targets, shard))
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets))


def test_scatter_into_parameters_and_channels_last():
    w = torch.nn.Parameter(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
    b = torch.nn.Parameter(torch.randn(2))
    ref = [w.detach().clone(), b.detach().clone()]
    layout = make_layout([w.numel(), b.numel()], 4, "balanced")
    flats = [gather([w, b], shard) for shard in layout.shards]
    with torch.no_grad():
        w.zero_(), b.zero_()
    for shard, flat in zip(layout.shards, flats):
        scatter_([w, b], shard, flat)
    assert torch.equal(w, ref[0]) and torch.equal(b, ref[1])
    assert w.is_contiguous(memory_format=torch.channels_last)


def test_scatter_rejects_wrong_size():
    t = [torch.zeros(4)]
    with pytest.raises(ValueError, match=r"flat has shape \(3,\), shard needs \(4,\)"):
        scatter_(t, (Segment(0, 0, 4),), torch.zeros(3))
