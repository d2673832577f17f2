"""ResumableDistributedSampler: determinism, disjoint coverage, mid-epoch and cross-world-size resume."""

from __future__ import annotations

import pytest
import torch

from shardtune.data import ResumableDistributedSampler, build_dataloader


def _samplers(n, world, **kw):
    return [ResumableDistributedSampler(n, num_replicas=world, rank=r, **kw) for r in range(world)]


def _take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = (
        ResumableDistributedSampler(50, num_replicas=1, rank=0, seed=3),
        ResumableDistributedSampler(50, num_replicas=1, rank=0, seed=3),
    )
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 + 2)).tolist()
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) == expected
    assert a.global_order(1) != a.global_order(2)
    assert ResumableDistributedSampler(50, num_replicas=1, rank=0, seed=4).global_order(2) != expected
    assert ResumableDistributedSampler(7, num_replicas=1, rank=0, shuffle=False).global_order(5) == list(range(7))


@pytest.mark.parametrize("drop_last", [True, False])
def test_replicas_are_disjoint_and_cover_the_epoch(drop_last):
    n, world = 23, 4
    parts = [list(s) for s in _samplers(n, world, seed=1, drop_last=drop_last)]
    assert len({len(p) for p in parts}) == 1
    flat = [i for p in parts for i in p]
    order = ResumableDistributedSampler(n, num_replicas=1, rank=0, seed=1).global_order(0)
    if drop_last:
        assert len(flat) == len(set(flat)) == 20
        assert sorted(flat) == sorted(order[:20])
    else:
        assert set(flat) == set(range(n)) and len(flat) == 24  # one index repeated as padding
    for r, part in enumerate(parts):
        assert part == [order[j % n] for j in range(r, len(flat), world)]
        assert len(part) == len(_samplers(n, world, seed=1, drop_last=drop_last)[r])


def test_mid_epoch_resume_continues_with_the_same_samples():
    n, world, per_step = 40, 2, 3
    full = [list(s) for s in _samplers(n, world, seed=7)]
    first = _samplers(n, world, seed=7)
    for s in first:
        s.set_epoch(0)
        _take(s, 2 * per_step)  # two steps
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states) and states[0]["consumed"] == 2 * per_step * world
    resumed = _samplers(n, world, seed=7)
    for s, st in zip(resumed, states):
        s.load_state_dict(st)
        s.set_epoch(0)  # same epoch: the position is kept
    for r in range(world):
        assert list(resumed[r]) == full[r][2 * per_step :]
    assert resumed[0].state_dict()["consumed"] == n
    resumed[0].set_epoch(1)
    assert resumed[0].consumed == 0 and len(list(resumed[0])) == n // world
    assert list(resumed[1]) == []  # iterating a finished epoch again yields nothing


@pytest.mark.parametrize("new_world", [4, 1, 3])
def test_resume_on_another_world_size_follows_the_global_order(new_world):
    n, seed = 61, 11
    order = ResumableDistributedSampler(n, num_replicas=1, rank=0, seed=seed).global_order(0)
    old = _samplers(n, 2, seed=seed)
    seen = [i for s in old for i in _take(s, 5)]
    state = old[0].state_dict()
    assert sorted(seen) == sorted(order[:10]) and state["consumed"] == 10
    new = _samplers(n, new_world, seed=seed)
    for s in new:
        s.load_state_dict(state)
    rest = order[10:]
    usable = len(rest) // new_world * new_world
    for r, s in enumerate(new):
        assert list(s) == rest[r:usable:new_world]
    # together: every sample of the epoch seen exactly once, minus the dropped tail
    later = [i for s in new for i in s.global_order(0)[10:][s.rank : usable : new_world]]
    assert sorted(seen + later) == sorted(order[: 10 + usable])


def test_load_state_dict_rejects_other_data_or_order():
    state = ResumableDistributedSampler(10, num_replicas=2, rank=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        ResumableDistributedSampler(10, num_replicas=2, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        ResumableDistributedSampler(11, num_replicas=2, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="rank=2 of 2"):
        ResumableDistributedSampler(10, num_replicas=2, rank=2)


def test_dataloader_state_is_exact_between_steps():
    data = [{"x": i} for i in range(30)]

    def collate(batch):
        return [b["x"] for b in batch]

    def loader_for(rank, world):
        return build_dataloader(
            data, batch_size=3, rank=rank, world_size=world, seed=5, shuffle=True, collate_fn=collate
        )

    uninterrupted = [list(loader_for(r, 2)[0]) for r in range(2)]
    assert [len(u) for u in uninterrupted] == [5, 5]
    states = []
    for r in range(2):
        loader, sampler = loader_for(r, 2)
        it = iter(loader)
        assert [next(it), next(it)] == uninterrupted[r][:2]
        states.append(sampler.state_dict())
    assert states[0] == states[1] and states[0]["consumed"] == 12
    for r in range(2):
        loader, sampler = loader_for(r, 2)
        sampler.load_state_dict(states[r])
        assert len(loader) == 3 and list(loader) == uninterrupted[r][2:]


def test_a_new_loader_iterator_leaves_the_global_rng_alone():
    """A run resumed mid-epoch makes one iterator more than the uninterrupted run: if each drew
    from torch's global RNG, the resumed run's dropout stream would be one draw off."""
    loader, _ = build_dataloader(
        list(range(12)), batch_size=2, rank=0, world_size=1, seed=3, shuffle=True, collate_fn=list
    )
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(3):
        next(iter(loader))
    assert torch.equal(torch.rand(3), expected)
