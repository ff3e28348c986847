import random

import pytest

from meshwise.sharding.plans import BucketPlan, ParamSpec

MB = 2**20


def _specs(numels, element_size=4, keys=None):
    keys = keys or [None] * len(numels)
    return [ParamSpec(f"p{i}", n, element_size, k) for i, (n, k) in enumerate(zip(numels, keys))]


def test_one_big_bucket_holds_everything_in_reverse_order():
    plan = BucketPlan(_specs([3, 5, 7]), bucket_cap_mb=25)
    assert len(plan.buckets) == 1
    bucket = plan.buckets[0]
    assert bucket.names == ("p2", "p1", "p0")
    assert bucket.numel == bucket.padded_numel == 15
    assert plan.slots["p2"].offset == 0
    assert plan.slots["p1"].offset == 7
    assert plan.slots["p0"].offset == 12
    assert plan.slots["p0"].numel == 3


def test_cap_splits_back_to_front():
    # Two 40-byte parameters fill an 80-byte bucket exactly.
    plan = BucketPlan(_specs([10, 10, 10, 10]), bucket_cap_mb=80 / MB)
    assert [b.names for b in plan.buckets] == [("p3", "p2"), ("p1", "p0")]
    assert [b.numel for b in plan.buckets] == [20, 20]
    assert plan.slots["p1"].bucket == 1 and plan.slots["p1"].offset == 0


def test_cap_boundary_is_inclusive_and_never_exceeded():
    # 30 + 30 > 50 bytes: each 30-byte parameter opens a new bucket.
    plan = BucketPlan(_specs([30, 30, 30], element_size=1), bucket_cap_mb=50 / MB)
    assert [b.names for b in plan.buckets] == [("p2",), ("p1",), ("p0",)]
    plan = BucketPlan(_specs([25, 25, 25], element_size=1), bucket_cap_mb=50 / MB)
    assert [b.names for b in plan.buckets] == [("p2", "p1"), ("p0",)]


def test_parameter_bigger_than_cap_gets_a_bucket_alone():
    plan = BucketPlan(_specs([10, 1000, 10, 10]), bucket_cap_mb=100 / MB)
    assert [b.names for b in plan.buckets] == [("p3", "p2"), ("p1",), ("p0",)]
    assert plan.buckets[1].numel == 1000


def test_group_keys_never_mix_and_buckets_follow_completion():
    keys = ["w", "b", "w", "b", "w", "b"]
    plan = BucketPlan(_specs([100, 1, 100, 1, 100, 1], keys=keys), bucket_cap_mb=25)
    assert len(plan.buckets) == 2
    for bucket in plan.buckets:
        assert len({keys[int(n[1:])] for n in bucket.names}) == 1
    # The "w" bucket completes when p0 arrives, the "b" bucket when p1 does, which
    # comes earlier in a back-to-front backward: "b" is bucket 0.
    assert plan.buckets[0].names == ("p5", "p3", "p1")
    assert plan.buckets[1].names == ("p4", "p2", "p0")
    assert plan.buckets[0].group_key == "b"


@pytest.mark.parametrize("pad_to", [1, 2, 3, 8])
def test_padding_makes_each_bucket_divisible(pad_to):
    plan = BucketPlan(_specs([5, 7, 11, 2]), bucket_cap_mb=40 / MB, pad_to=pad_to)
    for bucket in plan.buckets:
        assert bucket.padded_numel % pad_to == 0
        assert 0 <= bucket.padded_numel - bucket.numel < pad_to


def test_random_plans_keep_every_invariant():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        numels = [rng.randint(1, 300) for _ in range(n)]
        keys = [rng.choice("ab") for _ in range(n)]
        cap_bytes = rng.randint(4, 2000)
        pad_to = rng.randint(1, 5)
        specs = _specs(numels, keys=keys)
        plan = BucketPlan(specs, bucket_cap_mb=cap_bytes / MB, pad_to=pad_to)
        seen = []
        for index, bucket in enumerate(plan.buckets):
            assert bucket.index == index
            assert len({keys[int(name[1:])] for name in bucket.names}) == 1
            size = sum(numels[int(name[1:])] for name in bucket.names)
            assert size == bucket.numel
            assert size * 4 <= cap_bytes or len(bucket.names) == 1
            offset = 0
            order = [int(name[1:]) for name in bucket.names]
            assert order == sorted(order, reverse=True)
            for name in bucket.names:  # contiguous, non-overlapping slots
                slot = plan.slots[name]
                numel = numels[int(name[1:])]
                assert (slot.bucket, slot.offset, slot.numel) == (index, offset, numel)
                offset += slot.numel
            seen.extend(bucket.names)
        assert sorted(seen) == sorted(s.name for s in specs)
        # Launch order is completion order in a back-to-front backward.
        last = [min(int(name[1:]) for name in b.names) for b in plan.buckets]
        assert last == sorted(last, reverse=True)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketPlan(_specs([1]), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="pad_to"):
        BucketPlan(_specs([1]), bucket_cap_mb=1, pad_to=0)
    with pytest.raises(ValueError, match="unique"):
        BucketPlan([ParamSpec("a", 1, 4), ParamSpec("a", 2, 4)], bucket_cap_mb=1)
