"""Process groups rebuilt in place: every handle DeepSpeed holds is re-pointed to the new
generation's groups, and training continues bitwise as if nothing had happened.
Real ranks (2 processes, gloo, 127.0.0.1) under hotspare-run, per ZeRO stage."""
from __future__ import annotations

import json
import os

import pytest

from hotspare import launch
from hotspare.testing import statedigest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "rebuild_groups.py")


def run(tmp_path, stage, mode):
    out = tmp_path / mode
    out.mkdir()
    code = launch.run(launch.LaunchSpec(script=[WORKER, str(stage), mode, str(out)], nproc_per_node=2,
                                        extra_env={"OMP_NUM_THREADS": "1"}))
    assert code == 0
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# ZeRO 2 in make test; 1 and 3 in make slow (the suite's time budget).
SLOW_STAGES = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("stage", SLOW_STAGES)
def test_groups_rebuilt_in_place_keep_training_bitwise(stage, tmp_path, no_leaks):
    plain, rebuilt = run(tmp_path, stage, "plain"), run(tmp_path, stage, "rebuild")
    for a, b in zip(plain, rebuilt):
        assert a["losses"] == b["losses"]
        assert (a["fp32"], a["optim"]) == (b["fp32"], b["optim"])
        assert statedigest.differences(a["state"], b["state"]) == []
    found = rebuilt[0]["found"]
    # ZeRO 1/2 hold one clone of the world group (data parallel); ZeRO 3 also the default group.
    assert found["before"][0] == [[0, 1], False]
    if stage == 3:
        assert [[0, 1], True] in found["before"]
    assert found["replaced"] == found["refs"] > 0 and found["old_left"] == 0 and found["after"] == len(found["before"])


@pytest.mark.parametrize("stage", SLOW_STAGES)
def test_an_engine_builds_for_any_rank_in_a_fake_group(stage):
    """Pins what a spare relies on: torch's fake process group lets deepspeed.initialize build
    rank R's ZeRO engine with no peers, with the real partition sizes and group structure."""
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "workers", "fake_pg_engine.py")
    proc = subprocess.run([sys.executable, worker, str(stage), "1", "2"], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(result["partitions"]) * 2 >= result["num_params"]
    assert result["groups"][0] == [[0, 1], "fake"]
    assert len(result["groups"]) == (2 if stage == 3 else 1)


SIGNATURE_RANK = """
import sys
import torch.distributed as dist
from hotspare import rebuild
rank, init, out, same = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
try:
    rebuild.check_signature([rebuild.GroupRecord(None, (0, 1) if same or rank == 0 else (1,), "gloo", False)], 2)
    result = "agreed"
except RuntimeError as exc:
    result = str(exc)
finally:
    dist.destroy_process_group()
open(f"{out}.{rank}", "w", encoding="utf-8").write(result)
"""


@pytest.mark.parametrize("same", [True, False])
def test_ranks_that_hold_different_groups_are_refused_before_any_group_is_made(same, tmp_path):
    """The signature check (one int64 all-gather) passes when every rank records the same group
    structure, and names each rank's signature when one differs (a spare built differently)."""
    import subprocess
    import sys

    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "result")
    procs = [subprocess.Popen([sys.executable, "-c", SIGNATURE_RANK, str(r), init, out, "1" if same else "0"])
             for r in range(2)]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]
    results = [open(f"{out}.{r}", encoding="utf-8").read() for r in range(2)]
    if same:
        assert results == ["agreed", "agreed"]
    else:
        assert all("ranks disagree on the process groups to rebuild" in r for r in results), results


def test_the_walk_records_every_reference_and_repoint_records_replaces_them_all():
    """What a recovery relies on (one walk, not two): find_groups records a setter per reference,
    in dicts, lists, module attributes and a tensor's attribute dict, and repoint_records moves
    each to the new group; a group held in a tuple cannot be moved and is refused."""
    import torch
    import torch.distributed as dist

    from hotspare import rebuild

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        old, other = dist.new_group([0], backend="gloo"), dist.new_group([0], backend="gloo")
        module = torch.nn.Linear(2, 2)
        module.weight.ds_process_group = old  # like ZeRO-3's parameters
        module.group = old
        host = {"a": old, "b": [other, {"c": old}], "m": module}
        records = rebuild.find_groups([host])
        assert [len(r.refs) for r in records] == [4, 1] and [r.group for r in records] == [old, other]
        new_old, new_other = dist.new_group([0], backend="gloo"), dist.new_group([0], backend="gloo")
        assert rebuild.repoint_records(records, {id(old): new_old, id(other): new_other}) == 5
        assert host["a"] is host["b"][1]["c"] is module.group is module.weight.ds_process_group is new_old
        assert host["b"][0] is new_other
        assert [r.group for r in rebuild.find_groups([host])] == [new_old, new_other]
        stuck = rebuild.find_groups([{"t": (new_old,)}])
        with pytest.raises(RuntimeError, match="immutable"):
            rebuild.repoint_records(stuck, {id(new_old): old})
        # A group held 12 modules down (megatron-core's layers hold their tensor-parallel group
        # 7 down; the walk once counted two steps per module and missed them) is found.
        leaf = torch.nn.Module()
        leaf.tp_group = old
        root = leaf
        for _ in range(12):
            parent = torch.nn.Module()
            parent.child = root
            root = parent
        (deep,) = rebuild.find_groups([[root]])
        assert deep.group is old and len(deep.refs) == 1
        deep.refs[0](new_old)
        assert leaf.tp_group is new_old
        # An object reached first by a path too long to see under it, then by a short one: what
        # lies under it is found through the short one, and each reference once.
        shared = torch.nn.Module()
        shared.inner = torch.nn.Module()
        shared.inner.group = old
        long_path = shared
        for _ in range(rebuild.MAX_DEPTH - 1):  # shared is entered at the limit, its inner module not
            wrapper = torch.nn.Module()
            wrapper.child = long_path
            long_path = wrapper
        (found,) = rebuild.find_groups([[long_path, shared]])
        assert found.group is old and len(found.refs) == 1
        # A group captured in the closure of a host function hung on a parameter (ZeRO-3's
        # param.all_gather closes over its Init, whose ds_process_group the tripwire found): found
        # and re-pointed; a closure of any other package's function is not entered.

        def make(init):
            def all_gather():
                return init
            return all_gather

        holder = torch.nn.Linear(1, 1)
        fn = make(old)
        fn.__module__ = "deepspeed.runtime.zero.partition_parameters"
        holder.weight.all_gather = fn
        (closed,) = rebuild.find_groups([[holder]])
        assert closed.group is old and len(closed.refs) == 1
        closed.refs[0](new_old)  # the closure's cell
        assert fn() is new_old
        assert rebuild.find_groups([[make(old)]]) == []  # this test module's own function
        lookalike = make(old)
        lookalike.__module__ = "megatron_pp"  # a user's script: only the packages themselves count
        assert rebuild.find_groups([[lookalike]]) == []
    finally:
        dist.destroy_process_group()


def test_the_tripwire_names_objects_that_hold_a_destroyed_group():
    """hotspare.testing.groups.dead_groups_held, which the recovery tests assert empty: a group
    torch no longer has, held as an attribute or in a list attribute, is named by its holder."""
    import torch
    import torch.distributed as dist

    from hotspare.testing.groups import dead_groups_held

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        module = torch.nn.Linear(2, 2)
        module.tp_group = group
        module.groups = [group]
        module.cfg = {"tp": group}  # a dict of groups and plain values: not tracked by the collector
        assert dead_groups_held() == []
        dist.destroy_process_group(group)
        assert dead_groups_held() == ["torch.nn.modules.linear.Linear.cfg[tp]",
                                      "torch.nn.modules.linear.Linear.groups[0]",
                                      "torch.nn.modules.linear.Linear.tp_group"]
        del module
        assert dead_groups_held() == []
    finally:
        dist.destroy_process_group()
