"""In-place recovery end to end: real ZeRO ranks (4 active + spares over 2 logical nodes, gloo,
127.0.0.1) under hotspare-run; a rank is SIGKILLed (or SIGSTOPped) at a chosen step and phase,
a spare takes its place, and training finishes bitwise identical to an uninterrupted run with
the same seed: per-step losses, every rank's fp32 partition and optimizer state. No checkpoint
file is read or written."""
from __future__ import annotations

import glob
import json
import os

import pytest

from hotspare import launch
from hotspare.testing import statedigest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "recover.py")
WORKERS = os.path.dirname(WORKER)
STEPS = 6


def run(out, stage, kill="none", accum=1, spares=1, ckpt_every=0, collective_timeout_s=30.0, keeper=True, ranks=4,
        nodes=2, tier2="", rendezvous_timeout_s=60.0, case: tuple = ()):
    """``case``: (name, value) pairs of the worker's HS_TEST_* settings (tests/workers/tiny.py): the
    model, the optimizer, the dtype, a schedule and clipping."""
    out.mkdir(parents=True)
    code = launch.run(launch.LaunchSpec(keeper=keeper,
        script=[WORKER, str(stage), str(out), kill, str(accum), str(STEPS), str(ckpt_every)], nproc_per_node=ranks,
        logical_nodes=nodes, spares_per_node=spares, stall_grace_s=2.0,
        extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": WORKERS, "HS_TEST_TIER2": tier2,
                   "HS_TEST_SPARES": f"{nodes}:{spares}",
                   "HS_TEST_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
                   "HS_TEST_RENDEZVOUS_TIMEOUT_S": str(rendezvous_timeout_s),
                   **{f"HS_TEST_{k.upper()}": str(v) for k, v in case}}))
    results = {}
    for path in glob.glob(str(out / "*.json")):
        r = json.loads(open(path, encoding="utf-8").read())
        results[r["rank"]] = r
    return code, results


_REFERENCE: dict = {}


def reference(tmp_path_factory, stage, accum, ranks=4, case: tuple = ()):
    key = (stage, accum, ranks, case)
    if key not in _REFERENCE:
        code, results = run(tmp_path_factory.mktemp(f"ref-z{stage}-a{accum}-n{ranks}") / "out", stage, accum=accum,
                            spares=0, ranks=ranks, nodes=ranks // 2 if ranks % 2 == 0 else ranks, case=case)
        assert code == 0 and sorted(results) == list(range(ranks))
        _REFERENCE[key] = results
    return _REFERENCE[key]


def events(out) -> list[dict]:
    rows = []
    for path in glob.glob(str(out / "events" / "*.jsonl")):
        rows += [json.loads(line) for line in open(path, encoding="utf-8")]
    return rows


def assert_bitwise(ref, got, recoveries):
    assert sorted(got) == sorted(ref), f"ranks that finished: {sorted(got)}"
    for rank in sorted(ref):
        a, b = ref[rank], got[rank]
        assert b["global_steps"] == STEPS
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}, f"rank {rank}: losses differ"
        assert (b["fp32"], b["optim"]) == (a["fp32"], a["optim"]), f"rank {rank}: final state differs"
        assert statedigest.differences(a["state"], b["state"]) == [], f"rank {rank}: state differs"
        assert len(b["recoveries"]) == recoveries[rank]
        assert b["threads_after_close"] == [] and b["process_group_after_close"] is False
        assert b["dead_groups_held"] == [], f"rank {rank}: objects hold destroyed groups"
    for r in got.values():
        for rec in r["recoveries"]:
            if "failed_at" in rec and "fallback" not in rec:  # a survivor: at most one iteration lost
                assert rec["failed_at"] - rec["version"] <= 1, rec


# The cases of make test run ZeRO 2; ZeRO 1 and 3 run the same cases under make slow.
STAGES = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]


# In `make slow` (30 s): `make test` keeps a second failure in test_a_second_failure_while_the_
# first_recovery_forms_supersedes_it and in test_fault_matrix's kill@forward+kill@recovery case.
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_two_failures_in_sequence_rank1_forward_then_rank0_backward(stage, tmp_path, tmp_path_factory, no_leaks,
                                                                   capfd):
    """A non-zero rank dies before its forward; later rank 0 dies in the middle of backward (its
    gradient buckets partly reduced) and another spare takes it. The first takeover's successor
    starts once rank 0 says generation 1 is back at step 2 (after the replay)."""
    ref = reference(tmp_path_factory, stage, 1)
    code, got = run(tmp_path / "out", stage, kill="1:2:0:forward,0:4:0:backward")
    assert code == 0
    assert "starting spare s0.1 on node 0 (the generation caught up)" in capfd.readouterr().err
    # The first takeover uses the dead rank's own node's spare; the second any ready spare.
    assert got[1]["worker"] == "s0.0" and got[0]["spare"], {r: g["worker"] for r, g in got.items()}
    assert_bitwise(ref, got, {0: 1, 1: 2, 2: 2, 3: 2})  # a spare counts its takeover
    kinds = [e["kind"] for e in events(tmp_path / "out")]
    for kind in ("failure_seen", "plan", "rebuild", "restore", "resume", "takeover"):
        assert kind in kinds, f"no {kind} event"


# In `make slow` (60 s with its own reference run): `make test` keeps a kill during a mirror
# transfer in tests/test_mirror_kill.py and the fault-kind subset of tests/test_fault_matrix.py.
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_kill_between_micro_batches_and_during_a_mirror_transfer(stage, tmp_path, tmp_path_factory, no_leaks):
    """Gradient accumulation (2 micro-batches per step): rank 3 dies after its first micro-batch;
    later rank 2 dies while sending its mirror copy of the step it just took."""
    ref = reference(tmp_path_factory, stage, 2)
    code, got = run(tmp_path / "out", stage, kill="3:1:1:forward,2:3:0:mirror", accum=2)
    assert code == 0
    assert got[3]["spare"] and got[2]["spare"]
    assert_bitwise(ref, got, {0: 2, 1: 2, 2: 1, 3: 2})


@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_kill_in_the_optimizer_step_and_a_hung_rank(stage, tmp_path, tmp_path_factory, no_leaks):
    """Rank 2 dies just before its optimizer step; later rank 1 hangs (SIGSTOP): its launcher sees
    its heartbeat stop, kills it, and a spare takes its place the same way."""
    ref = reference(tmp_path_factory, stage, 1)
    code, got = run(tmp_path / "out", stage, kill="2:1:0:step,1:3:0:hang")
    assert code == 0
    assert_bitwise(ref, got, {0: 2, 1: 1, 2: 2, 3: 2})
    failures = [f for r in got.values() for rec in r["recoveries"] for f in rec["failures"]]
    assert {f["reason"] for f in failures} == {"exit", "heartbeat"}


def run_plain(out, stage, accum=1, ranks=4) -> dict[int, dict]:
    """recover.py's model, data and loop on plain DeepSpeed under torchrun: no hotspare."""
    import socket
    import subprocess
    import sys

    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                    "--master-addr=127.0.0.1", f"--master-port={port}",
                    os.path.join(WORKERS, "plain_deepspeed.py"), str(stage), str(out), str(accum), str(STEPS)],
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": WORKERS}, check=True, timeout=300)
    return {r["rank"]: r for r in (json.loads(open(p, encoding="utf-8").read()) for p in glob.glob(str(out / "*.json")))}


def test_without_a_fault_hotspare_trains_exactly_as_plain_deepspeed(tmp_path, tmp_path_factory, no_leaks):
    """The references of these tests run under hotspare (its launcher, session, mirror and
    keeper): the same model, config and data on plain DeepSpeed under torchrun end with the same
    losses and the same whole state on every rank, RNG and counters included."""
    ref = reference(tmp_path_factory, 2, 1)
    plain = run_plain(tmp_path / "plain", 2)
    assert sorted(plain) == sorted(ref)
    for rank, a in plain.items():
        b = ref[rank]
        assert (b["losses"], b["global_steps"]) == (a["losses"], a["global_steps"]), rank
        assert statedigest.differences(a["state"], b["state"]) == [], rank


def test_losing_a_rank_and_its_only_mirror_holder_stops_every_rank_with_what_was_lost(tmp_path, no_leaks):
    """Rank 1's only copy lives on rank 3 (placement {0: [2], 1: [3], 2: [1], 3: [0]}): both die in the same step. No version
    of their state exists anywhere (no keeper: as if both nodes were lost), so the job stops with an
    error saying so (no checkpoint)."""
    code, got = run(tmp_path / "out", 2, kill="1:2:0:forward,3:2:0:forward", keeper=False)
    assert code == launch.ABORT_EXIT_CODE
    assert got == {}
    fallback = [e for e in events(tmp_path / "out") if e["kind"] == "fallback"]
    assert fallback and all("every copy of rank(s) 1 is lost" in e["reason"] for e in fallback), fallback[0]["reason"]


@pytest.mark.parametrize("stage", STAGES)
def test_losing_a_rank_and_its_only_holder_falls_back_on_the_persistent_checkpoint(stage, tmp_path, tmp_path_factory,
                                                                                  no_leaks):
    """The same double loss (no keeper) with a DeepSpeed checkpoint every 2 steps: every rank (two of
    them spares) loads the newest complete one, runs the steps since again and finishes bitwise
    identical to the uninterrupted run."""
    ref = reference(tmp_path_factory, stage, 1)
    code, got = run(tmp_path / "out", stage, kill="1:5:0:forward,3:5:0:forward", ckpt_every=2, keeper=False)
    assert code == 0
    assert got[1]["spare"] and got[3]["spare"]
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1, 3: 1})
    fallback = [e for e in events(tmp_path / "out") if e["kind"] == "fallback"]
    assert len(fallback) == 4 and len({e["checkpoint"] for e in fallback}) == 1, fallback
    landed = fallback[0]["version"]
    # Step 4's files may still have been in flight on the ranks that died: 2 or 4, never partial.
    assert landed in (2, 4) and fallback[0]["checkpoint"].endswith(f"global_step{landed}")
    assert all("every copy of rank(s) 1" in e["reason"] for e in fallback)
    restores = [e for e in events(tmp_path / "out") if e["kind"] == "restore"]
    assert {e["source"] for e in restores} == {"checkpoint"}
    # keep=2: the newest two complete checkpoints remain (the last one written at step 6).
    kept = sorted(n for n in os.listdir(tmp_path / "out" / "ckpt") if n.startswith("global_step"))
    assert kept == ["global_step4", "global_step6"], kept


@pytest.mark.parametrize("stage", STAGES)
def test_a_stuck_rank_that_keeps_beating_is_found_by_the_collective_timeout(stage, tmp_path, tmp_path_factory,
                                                                          no_leaks):
    """Rank 1's training thread stops for good before step 2 while its heartbeat goes on: its
    peers' collectives time out (8 s here; DeepSpeed's own groups get the configured timeout,
    not torch's 30 min), they report, rank 1 does not, the coordinator has it killed
    ('watchdog') and a spare takes it."""
    ref = reference(tmp_path_factory, stage, 1)
    code, got = run(tmp_path / "out", stage, kill="1:2:0:wedge", collective_timeout_s=8.0)
    assert code == 0
    assert got[1]["spare"]
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1, 3: 1})
    (failure,) = got[0]["recoveries"][0]["failures"]
    assert failure["reason"] == "watchdog" and failure["rank"] == 1, failure  # killed for its peers' timeouts (below)
    seen = [e for e in events(tmp_path / "out") if e["kind"] == "failure_seen"]
    assert any(e["timed_out"] for e in seen), seen


@pytest.mark.slow
def test_a_survivor_stuck_in_the_failed_generation_is_killed_and_replaced_too(tmp_path, tmp_path_factory, no_leaks):
    """Rank 3's training thread stops for good before step 2 (its heartbeat goes on; the alarm's
    broken sockets do not reach it: as a gloo wait that ignored them was seen to), and rank 1
    dies a second later, blocked in step 2 on rank 3. The plan for rank 1 is made at once;
    rank 3 never says it left generation 0, so once the others' rendezvous (15 s here) is four
    fifths through, the coordinator has it killed, the generation that waited for it is
    superseded, a spare on rank 3's node takes it, and training finishes bitwise identical.
    Without that the others' rendezvous timed out and the job failed."""
    ref = reference(tmp_path_factory, 2, 1)
    code, got = run(tmp_path / "out", 2, kill="1:2:0:later,3:2:0:wedge", rendezvous_timeout_s=15.0)
    assert code == 0
    assert got[1]["spare"] and got[3]["spare"]
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1, 3: 1})
    rows = events(tmp_path / "out")
    failures = {f["rank"]: f for e in rows if e["kind"] == "plan" for f in e["failures"]}
    assert failures[3]["reason"] == "watchdog" and failures[1]["reason"] == "exit", failures
    assert "retry" in [e["kind"] for e in rows]


def test_a_transient_fault_with_nobody_dead_rebuilds_with_the_same_workers(tmp_path, tmp_path_factory, no_leaks):
    """Rank 2 raises a collective timeout once and nobody dies: every rank reports, the
    coordinator plans the next generation with the same workers, no spare is used, and
    training lands on the step every rank holds and finishes bitwise identical."""
    ref = reference(tmp_path_factory, 2, 1)
    code, got = run(tmp_path / "out", 2, kill="2:3:0:transient")
    assert code == 0
    assert not any(r["spare"] for r in got.values())
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1, 3: 1})
    for r in got.values():
        (rec,) = r["recoveries"]
        assert rec["replaced"] == {} and rec["failures"] == [] and rec["version"] == 3


def test_a_second_failure_while_the_first_recovery_forms_supersedes_it(tmp_path, tmp_path_factory, no_leaks):
    """Rank 1 dies before step 2; while generation 1 forms, rank 0 dies as it arrives. The
    coordinator plans generation 2 (rank 0 -> another spare), everyone waiting for generation 1
    moves on to it, the spare promoted in generation 1 is restored there, and training finishes
    bitwise identical."""
    ref = reference(tmp_path_factory, 2, 1)
    code, got = run(tmp_path / "out", 2, kill="1:2:0:forward,0:0:0:join")
    assert code == 0
    assert got[0]["spare"] and got[1]["spare"]
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1, 3: 1})
    assert {rec["generation"] for r in got.values() for rec in r["recoveries"]} == {2}
    kinds = [e["kind"] for e in events(tmp_path / "out")]
    assert "retry" in kinds


def _restores(out, generation) -> dict[int, dict]:
    return {e["rank"]: e for e in events(out) if e["kind"] == "restore" and e["generation"] == generation}


@pytest.mark.slow  # make test runs the cut points after the seal below; the unit tests every one
def test_a_trainer_killed_inside_its_keeper_update_recovers_from_the_keeper(tmp_path, tmp_path_factory, no_leaks):
    """Rank 1 dies in the middle of writing step 2's snapshot into its keeper segment; later rank 2
    dies after writing step 4's, between two of its seal records. Each time the spare on the
    dead rank's node takes the version its keeper holds complete (the one before), no state
    byte crosses the network, and training finishes bitwise identical."""
    ref = reference(tmp_path_factory, 2, 1)
    code, got = run(tmp_path / "out", 2, kill="1:2:0:write,2:4:0:seal")
    assert code == 0
    assert got[1]["worker"] == "s0.0" and got[2]["worker"] == "s1.0"
    assert_bitwise(ref, got, {0: 2, 1: 2, 2: 1, 3: 2})
    for generation, rank in ((1, 1), (2, 2)):
        restores = _restores(tmp_path / "out", generation)
        assert restores[rank]["source"] == "keeper", restores[rank]
        assert all(r["bytes_in"] == 0 and r["bytes_out"] == 0 for r in restores.values()), restores
        attach = [e for e in events(tmp_path / "out") if e["kind"] == "keeper_attach" and e["generation"] == generation]
        # The update in progress never counts: the keeper offers only the version before it.
        (a,) = attach
        assert a["verified"] == [restores[rank]["version"]] and a["corrupt_chunks"] == {}, a


def test_after_the_seal_and_a_corrupted_keeper_copy(tmp_path, tmp_path_factory, no_leaks):
    """Rank 3 dies in its mirror round between the checksum records of two chunks: step 2's
    update was sealed right after the step, so the spare restores it from the keeper (chunk 0
    checked, the rest reported unverified) and no iteration is lost. Later rank 0's keeper copies
    are corrupted (after their checksums) before it dies: the spare's checks reject them, and it
    is restored from its peers' mirror instead."""
    ref = reference(tmp_path_factory, 2, 1)
    code, got = run(tmp_path / "out", 2, kill="3:2:0:commit1,0:4:0:corrupt")
    assert code == 0
    assert_bitwise(ref, got, {0: 1, 1: 2, 2: 2, 3: 2})
    first = _restores(tmp_path / "out", 1)
    assert first[3]["source"] == "keeper" and first[3]["version"] == 3, first[3]  # the state after step 2
    assert all(r["version"] == 3 for r in first.values()), first
    (attach,) = [e for e in events(tmp_path / "out") if e["kind"] == "keeper_attach" and e["generation"] == 1]
    assert 3 in attach["verified"] and attach["unverified_chunks"].get("3", 0) > 0, attach
    second = _restores(tmp_path / "out", 2)
    assert second[0]["source"] == "peers" and second[0]["bytes_in"] > 0, second[0]
    (attach,) = [e for e in events(tmp_path / "out") if e["kind"] == "keeper_attach" and e["generation"] == 2]
    assert attach["verified"] == [] and len(attach["corrupt_chunks"]) == 2, attach


def test_losing_a_whole_node_is_recovered_by_decoding_the_stripe(tmp_path, tmp_path_factory, no_leaks):
    """Tier 2 = zfec stripe (k=2, m=1) over 3 logical nodes of one rank each: node 1 is lost
    (its rank, its spare and its keeper SIGKILLed together). A spare of another node decodes
    rank 1's state from the two shares on nodes 0 and 2, and training finishes bitwise
    identical to an uninterrupted run."""
    ref = reference(tmp_path_factory, 2, 1, ranks=3)
    code, got = run(tmp_path / "out", 2, kill="1:3:0:node", ranks=3, nodes=3, tier2="stripe:2:1")
    assert code == 0
    assert got[1]["spare"] and got[1]["worker"] != "s1.0"
    assert_bitwise(ref, got, {0: 1, 1: 1, 2: 1})
    restores = _restores(tmp_path / "out", 1)
    assert restores[1]["source"] == "stripe" and restores[1]["sources"] == ["stripe", 0, 2], restores[1]
    (attach,) = [e for e in events(tmp_path / "out") if e["kind"] == "keeper_attach"]
    assert attach["retained"] is False  # the spare's own node's keeper never had rank 1


# Users' models and DeepSpeed configs (issue 26): transformers families and a module with a
# running-statistic buffer and a frozen parameter, with DeepSpeed's default optimizer, a WarmupLR
# schedule and gradient clipping from the JSON, dropout on. make test runs GPT-2 on ZeRO 2 and the
# buffer/frozen module; make slow the rest of the matrix.
# make test runs two: ZeRO 1 in bf16 with a transformers model (killed between micro-batches), and
# ZeRO 3 with a buffer and a frozen parameter; ZeRO 2 recovers in the tests above.
IN_MAKE_TEST = {"z1-hf_gpt2-bf16", "z3-stats"}
USERS = [
    *[pytest.param(stage, (("model", model), ("extras", 1), *more), id=f"z{stage}-{model}{label}",
                   marks=() if f"z{stage}-{model}{label}" in IN_MAKE_TEST else pytest.mark.slow)
      for model in ("hf_gpt2", "hf_llama", "hf_opt") for stage in (1, 2, 3)
      for label, more in (("", ()), ("-bf16", (("dtype", "bf16"),)), ("-torch_adam", (("optimizer", "torch_adam"),)))],
    *[pytest.param(stage, (("model", "stats"),), id=f"z{stage}-stats",
                   marks=() if f"z{stage}-stats" in IN_MAKE_TEST else pytest.mark.slow) for stage in (1, 2, 3)],
    # The optimizers DeepSpeed builds from other JSON sections, and a client optimizer.
    *[pytest.param(stage, (("model", "gpt"), ("optimizer", kind)), id=f"z{stage}-{kind}", marks=pytest.mark.slow)
      for kind in ("offload", "adagrad_offload", "lion_offload", "adagrad", "client") for stage in (2, 3)],
]


@pytest.mark.parametrize("stage,case", USERS)
def test_users_models_and_configs_recover_bitwise(stage, case, tmp_path, tmp_path_factory, no_leaks):
    """Rank 1 dies before its forward at step 2 (for the transformers models, which accumulate
    gradients over 2 micro-batches: before the second, with the first's gradients reduced) and a
    spare takes it; then rank 2 dies in its optimizer step at step 4. Every rank's whole state
    (module, optimizer entries of any type, counters, RNG, scheduler) ends as in an uninterrupted
    run."""
    accum = 2 if dict(case)["model"].startswith("hf_") else 1
    ref = reference(tmp_path_factory, stage, accum, case=case)
    code, got = run(tmp_path / "out", stage, kill=f"1:2:{accum - 1}:forward,2:4:0:step", accum=accum, case=case)
    assert code == 0
    assert got[1]["spare"] and got[2]["spare"]
    assert_bitwise(ref, got, {0: 2, 1: 2, 2: 1, 3: 2})
