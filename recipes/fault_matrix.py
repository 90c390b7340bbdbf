"""The fault matrix: every fault kind of the catalogue (``hotspare.testing.faults``) in every phase
it applies to, on rank 0, a middle rank, the last rank and the spare itself, for DeepSpeed (each
ZeRO stage) and megatron-core (PP=2 x DP=2), on the GPT smoke model; each case against an
uninterrupted run of the same job.

    python recipes/fault_matrix.py out=faults.json                          # the whole matrix (long: make faults)
    python recipes/fault_matrix.py out=f.json frameworks=[zero2] kinds=[kill,hang] targets=[first]
    python recipes/fault_matrix.py out=f.json 'cases=[zero2/segv@backward:0:3,megatron/slow@mirror:3:3]'
    python recipes/fault_matrix.py out=faults.json docs=docs/faults.md      # also regenerate the docs table

A case is ``FRAMEWORK/FAULT[+FAULT...]`` (a fault in the catalogue's notation, ``kill@forward:1:3``).
Faults on the spare and faults during a recovery need a first failure to call the spare in or to
start the recovery: the matrix adds ``kill@forward:T:STEP`` of another rank T (on the other
logical node) to those cases.

Outcomes: ``recovered`` (the launcher finished, every rank's final fp32 state, optimizer state and
losses are bitwise those of the uninterrupted run, and a recovery took place), ``fell_back`` (the
same, through the persistent checkpoint), ``stopped_cleanly`` (the job stopped with the
coordinator's "cannot recover" or the lost-state error, exit code 3 or the failed worker's),
``wrong`` (finished, but not bitwise equal, or no recovery took place although a fault was
injected), ``hung`` (past ``case_timeout_s``), ``crashed`` (any other end).

JSON: ``rows`` (one per case: ``case``, ``fault``, ``phase``, ``rank``, ``framework``, ``outcome``,
``bitwise_identical``, ``lost_iterations``, ``recovery_s``, ``seconds``, ``note``), ``summary``
(count per outcome, ``all_acceptable``, ``max_lost_iterations``). ``docs=PATH`` writes the
markdown table.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hotspare.config import from_mapping
from hotspare.testing import job as gpt_job
from hotspare.testing.harness import Job, count_events, ranks_of, sweep, training_started
from hotspare.testing.matrix import (ACCEPTABLE, OUTCOMES, PROBE_KILL_STEP, SLOW_MBIT, FaultMatrixConfig, classify,
                                     describe, framework_job, handed_over, parse_case, parse_probe, product,
                                     straggler_cases, write_table)

MEGATRON_OVERRIDES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "framework",
                                  "megatron.yaml")
gpt_job.register()
ConfigStore.instance().store(name="fault_matrix_schema", node=FaultMatrixConfig)


def straggler_data(data: dict, matrix: FaultMatrixConfig) -> dict:
    """The straggler cases' job: longer, straggler detection on, megatron on one pipeline stage
    (its ranks are compared within a stage, and a class needs three)."""
    hs = data["hotspare"]
    return {**data, "train": {**data["train"], "steps": matrix.straggler_steps},
            "hotspare": {**hs, "stragglers": {**hs.get("stragglers", {}), "enabled": True, "factor": 2.0,
                                              "window": 5}}}


def job_of(data: dict, framework: str, one_stage: bool = False) -> gpt_job.GPTJobConfig:
    """The job on ``framework``; megatron on one pipeline stage with ``one_stage``."""
    megatron = OmegaConf.to_container(OmegaConf.load(MEGATRON_OVERRIDES))
    if one_stage:
        megatron["parallel"]["pipeline_stages"] = 1
    return framework_job(data, framework, megatron)


def run_job(job, out_dir: str, spares: int, timeout_s: float, **options) -> tuple[int | None, str]:
    """The job under hotspare-run in a process of its own; (exit code, or None when it was still
    running after ``timeout_s`` and was stopped; the launcher's output, its end)."""
    spec = gpt_job.launch_spec(job, out_dir, spares_per_node=spares, mode="hotspare",
                               **options)
    handle = Job(spec, out_dir, name="fm")
    code = handle.wait(timeout_s)
    return code, handle.tail()


def run_on_hosts(job, out_dir: str, spares: int, timeout_s: float, node_timeout_s: float, fault: str = "",
                 after_s: float = 0.0) -> tuple[int | None, str, dict]:
    """The job on two hosts (network namespaces), one hotspare-run each (``--nnodes 2``); ``fault``
    (cut, slow, node) strikes host 1 ``after_s`` seconds after training started. Returns node 0's
    exit code (None: hung), its output's end, and what happened on host 1."""
    from hotspare.control import auth
    from hotspare.testing.netns import Hosts

    base = gpt_job.launch_spec(job, out_dir, spares_per_node=spares, mode="hotspare")
    per_node = job.parallel.num_ranks // 2
    info: dict = {}
    secret_file = auth.write_secret_file(os.path.join(out_dir, "job.secret"))
    job_id = f"hosts{os.getpid()}"
    with Hosts(2) as hosts:
        launchers = []
        for i in range(2):
            spec = dataclasses.replace(base, nnodes=2, node_rank=i, nproc_per_node=per_node, logical_nodes=1,
                                       master_addr=hosts.addr(0), master_port=29400, job_id=job_id,
                                       node_timeout_s=node_timeout_s, job_secret_file=secret_file)
            launchers.append(Job(spec, out_dir, log_name=f"launcher{i}.log", wrap=lambda argv, i=i: hosts.run(i, argv)))
            if i == 0:
                time.sleep(1.0)  # node 0 opens the store first
        t0 = time.monotonic()
        if fault:
            events = os.path.join(out_dir, "events")
            while time.monotonic() - t0 < timeout_s and launchers[0].running() and not training_started(events):
                time.sleep(0.2)
            time.sleep(after_s)
            info["fault_at_s"] = time.monotonic() - t0
            if fault == "cut":
                hosts.cut(1)
            elif fault == "blip":
                hosts.cut(1)
                time.sleep(node_timeout_s / 2)
                hosts.heal(1)
            elif fault in ("launcher0", "launcher1"):
                info["alive_before"] = len(sweep(job_id))
                launchers[int(fault[-1])].proc.kill()
                deadline = time.monotonic() + 15
                if fault == "launcher0":
                    while sweep(job_id) and time.monotonic() < deadline:
                        time.sleep(0.2)
                    info["alive_after_15s"] = len(sweep(job_id))
                else:  # host 1's own processes: its launcher's workers, spares and keeper
                    while hosts.host_pids(1) and time.monotonic() < deadline:
                        time.sleep(0.2)
                    info["host1_alive_after_15s"] = len(hosts.host_pids(1))
            elif fault == "keeper":
                keepers = launchers[1].keeper_pids()
                info["keeper_killed"] = bool(keepers)
                for pid in keepers:
                    os.kill(pid, signal.SIGKILL)
            elif fault == "node":
                for pid in hosts.host_pids(1):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            elif fault == "slow":
                # Everything host 1 sends or receives (collectives too) crawls; the mirror's
                # transfers miss the in-flight window (the next step waits: mirror_wait
                # events). Then a rank of host 1 dies mid-crawl, and the link comes back.
                info["qdisc"] = hosts.slow(1, SLOW_MBIT)
                time.sleep(after_s)
                launchers[1].kill(f"a{job.parallel.num_ranks - 1}")
                time.sleep(after_s)
                hosts.unslow(1)
        try:
            code = launchers[0].proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            code = None
        for launcher in launchers[1:]:
            try:
                info["host1_exit"] = launcher.proc.wait(timeout=node_timeout_s * 4 + 30)
            except subprocess.TimeoutExpired:
                info["host1_exit"] = None
        if fault == "keeper":
            info["keeper_named"] = any("the keeper of node" in launcher.tail(1 << 30) for launcher in launchers)
        for launcher in launchers:
            if launcher.running():
                launcher.proc.kill()
                launcher.proc.wait()
    if fault == "node":
        # A lost machine's /tmp and /dev/shm go with it; the two hosts here share this machine's,
        # so what host 1's killed keeper left there (its socket, its segments) is discarded.
        from hotspare import keeper

        left = keeper.remove_stale()
        sock = keeper.socket_path(job_id, 1)
        if os.path.exists(sock):
            os.unlink(sock)
            left.append(os.path.basename(sock))
        info["host1_left"] = left
    return code, launchers[0].tail(), info


def hosts_mode(matrix: FaultMatrixConfig, data: dict, run_dir: str) -> list[dict]:
    """The host faults on two network-namespace hosts, per framework; [] with a message when
    namespaces cannot be made here."""
    from hotspare.testing.netns import available

    ok, why = available()
    if not ok:
        print(f"fault_matrix: hosts mode skipped: {why}", flush=True)
        return []
    rows, world = [], matrix.parallel.num_ranks
    for framework in matrix.frameworks:
        job = job_of(data, framework)
        ref_dir = os.path.join(run_dir, f"hosts-uninterrupted-{framework}")
        os.makedirs(ref_dir, exist_ok=True)
        code, tail, _ = run_on_hosts(job, ref_dir, 0, matrix.case_timeout_s, matrix.node_timeout_s)
        ref = ranks_of(ref_dir)
        if code != 0 or sorted(ref) != list(range(world)):
            sys.exit(f"fault_matrix: the uninterrupted {framework} run on two hosts failed (exit {code}):\n{tail}")
        for fault in matrix.host_faults:
            out_dir = os.path.join(run_dir, f"hosts-{framework}-{fault}")
            os.makedirs(out_dir, exist_ok=True)
            t0 = time.monotonic()
            code, tail, info = run_on_hosts(job, out_dir, matrix.spares, matrix.case_timeout_s,
                                            matrix.node_timeout_s, fault, matrix.host_fault_after_s)
            row = classify(code, tail, ranks_of(out_dir), ref, world)
            if fault == "launcher0":
                clean = info["alive_after_15s"] == 0 and info["alive_before"] > 0 and info.get("host1_exit") == 4
                row = {**row, "outcome": "stopped_cleanly" if clean else "wrong", "note":
                       "node 1 fenced (exit 4); nothing of the job alive 15 s after node 0's launcher died" if clean
                       else f"{info['alive_after_15s']} process(es) alive 15 s later, node 1's exit "
                            f"{info.get('host1_exit')}"}
            elif fault == "launcher1" and info.get("host1_alive_after_15s") != 0:
                row = {**row, "outcome": "wrong", "note": f"{info.get('host1_alive_after_15s')} process(es) of host 1 "
                                                          f"alive 15 s after its launcher's SIGKILL"}
            elif fault == "keeper" and not (info.get("keeper_killed") and info.get("keeper_named")):
                row = {**row, "outcome": "wrong", "note": "no keeper was killed on host 1, or no launcher said so"}
            elif fault in ("blip", "keeper") and row["outcome"] == "wrong" and row["bitwise_identical"]:
                row = {**row, "outcome": "unaffected", "note": "the link came back before node 0 gave node 1 up"
                       if fault == "blip" else "host 1's keeper's loss named; the job trained on bitwise"}
            info["mirror_waits"] = count_events(os.path.join(out_dir, "events"), "mirror_wait")
            row = {"case": f"hosts/{framework}/{fault}", "fault": f"host_{fault}", "phase": "any",
                   "rank": "host 1", "framework": framework, **row, "seconds": time.monotonic() - t0,
                   "exit_code": code, "dir": out_dir, **info}
            rows.append(row)
            print(f"hosts/{framework}/{fault}: {row['outcome']} (lost {row['lost_iterations']}, recovery "
                  f"{row['recovery_s']}, host 1 exit {info.get('host1_exit')}) {row['note']}", flush=True)
    return rows


def _probe_verdict(probe: str, row: dict, tail: str, info: dict, kill: bool) -> dict:
    """A stranger's probe: the job ends bitwise as if nothing happened (``unaffected``), or with
    the one real failure recovered (``+kill``: ``recovered``, one generation), and every key the
    job read is named as not signed (``probes.must_name``)."""
    generations = info.get("generations", [])
    if kill:
        ok = row["outcome"] == "recovered" and generations == [1]
    else:
        ok = row["outcome"] == "wrong" and row.get("bitwise_identical") and "no recovery took place" in row["note"]
    said = "counted in" if probe == "hole" else "not signed"
    missing = [k for k in info.get("must_name", []) if f"control store key {k!r}: {said}" not in tail]
    refused = probe not in ("second_job", "second_node0") or info.get("intruder_refused")
    if ok and not missing and refused:
        what = "recovered the real failure bitwise, one generation" if kill else "finished bitwise as if nothing happened"
        return {**row, "outcome": "recovered" if kill else "unaffected",
                "note": what + (f"; {len(info['must_name'])} forged keys named" if info.get("must_name") else "")}
    why = (f"keys not named: {', '.join(missing)}" if missing else "the intruder was not refused" if not refused
           else f"{row['outcome']} ({row['note']}), generations {generations}")
    return {**row, "outcome": "wrong", "note": why}


def _intrude(probe: str, port: int, out_dir: str) -> dict:
    """Another hotspare-run with a secret of its own on the job's port: as node 1 of two
    (second_job), or as a single-node job's node 0 (second_node0). It must exit 2 with one line."""
    from hotspare.control import auth

    secret = auth.write_secret_file(os.path.join(out_dir, "intruder.secret"))
    nodes = ["--nnodes", "2", "--node-rank", "1"] if probe == "second_job" else []
    intruder = subprocess.run([sys.executable, "-m", "hotspare.launch", *nodes, "--master-port", str(port),
                               "--job-secret-file", secret, gpt_job.WORKER], capture_output=True, text=True,
                              timeout=120)
    said = intruder.stderr.strip().splitlines()[-2:] if intruder.stderr else []
    expected = "not signed" if probe == "second_job" else str(port)
    return {"intruder_exit": intruder.returncode, "intruder_said": " | ".join(said)[-400:],
            "intruder_refused": intruder.returncode not in (0, None) and any(expected in line for line in said)}


def control_mode(matrix: FaultMatrixConfig, data: dict, run_dir: str) -> list[dict]:
    """The control-plane probes against the ZeRO 2 job, each in a run of its own, against an
    uninterrupted run (see ``_probe_verdict``); for the kills ``stopped_cleanly`` (no process of
    the job left 15 s later) or the keeper's loss named."""
    import datetime

    import torch.distributed as dist

    from hotspare.testing import probes

    world = matrix.parallel.num_ranks
    target = probes.Target(world, matrix.parallel.logical_nodes)
    job = job_of({**data, "train": {**data["train"], "steps": matrix.control_steps}}, "zero2")
    ref_dir = os.path.join(run_dir, "control-uninterrupted")
    code, tail = run_job(job, ref_dir, 0, matrix.case_timeout_s)
    ref = ranks_of(ref_dir)
    if code != 0 or sorted(ref) != list(range(world)):
        sys.exit(f"fault_matrix: the uninterrupted control-mode run failed (exit {code}):\n{tail}")
    rows = []
    for n, probe in enumerate(matrix.control_probes):
        way, families, kill = parse_probe(probe)
        out_dir = os.path.join(run_dir, f"control{n:02d}")
        faults = [f"kill@forward:{world - 1}:{PROBE_KILL_STEP}"] if kill else []
        spec = gpt_job.launch_spec(job, out_dir, spares_per_node=1, mode="hotspare", faults=faults)
        spec.job_id = f"cp{os.getpid()}n{n}"
        t0 = time.monotonic()
        info: dict = {}
        handle = Job(spec, out_dir)
        try:
            events = os.path.join(out_dir, "events")
            while handle.running() and not training_started(events) and time.monotonic() - t0 < matrix.case_timeout_s:
                time.sleep(0.1)
            info["probe_at_s"] = time.monotonic() - t0
            port = handle.port()
            if way in probes.WAYS + ("replay", "hole"):
                stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
                written = probes.replay(stranger, target) if way == "replay" else \
                    probes.holes(stranger) if way == "hole" else probes.write(stranger, way, families, target)
                info["keys"] = written
                info["must_name"] = probes.must_name(way, families, kill, written, target)
            elif probe in ("second_job", "second_node0"):
                info.update(_intrude(probe, port, out_dir))
            elif probe == "kill_keeper":
                keepers = handle.keeper_pids()
                info["keeper_killed"] = bool(keepers)
                if keepers:
                    os.kill(keepers[0], signal.SIGKILL)
            elif probe == "kill_launcher":
                alive_before = len(sweep(spec.job_id))
                handle.proc.kill()
                handle.proc.wait()
                deadline = time.monotonic() + 15
                while sweep(spec.job_id) and time.monotonic() < deadline:
                    time.sleep(0.2)
                info["alive_after_15s"] = len(sweep(spec.job_id))
                info["alive_before"] = alive_before
            code = handle.wait(matrix.case_timeout_s - (time.monotonic() - t0))
        finally:
            handle.stop()
        tail = handle.tail(1 << 30)
        ranks = ranks_of(out_dir)
        info["generations"] = sorted({rec["generation"] for r in ranks.values() for rec in r.get("recoveries", [])})
        row = classify(code, tail[-4000:], ranks, ref, world)
        if probe == "kill_keeper":
            if not (info.get("keeper_killed") and "the keeper of node" in tail):
                row = {**row, "outcome": "wrong", "note": "no keeper was killed, or its launcher did not say so"}
            elif row["outcome"] == "wrong" and row.get("bitwise_identical"):
                row = {**row, "outcome": "unaffected", "note": "its loss named; the job trained on bitwise"}
        elif probe == "kill_launcher":
            clean = info["alive_after_15s"] == 0 and info["alive_before"] > 0
            row = {**row, "outcome": "stopped_cleanly" if clean else "wrong",
                   "note": "nothing of the job alive 15 s after its launcher's SIGKILL" if clean else
                   f"{info['alive_after_15s']} process(es) of the job alive 15 s after its launcher's SIGKILL"}
        else:
            row = _probe_verdict(probe, row, tail, info, kill)
        rows.append({"case": f"control/{probe}", "fault": probe, "phase": "training", "rank": "-",
                     "framework": "zero2", **row, "seconds": time.monotonic() - t0, "exit_code": code,
                     "dir": out_dir, **info})
        print(f"control/{probe}: {rows[-1]['outcome']} {rows[-1]['note']}", flush=True)
    return rows


@hydra.main(version_base=None, config_path="../configs", config_name="fault_matrix")
def main(cfg) -> None:
    t_start = time.monotonic()
    data = OmegaConf.to_container(cfg, resolve=True)
    matrix = from_mapping(FaultMatrixConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    world, per_node = matrix.parallel.num_ranks, matrix.parallel.num_ranks // matrix.parallel.logical_nodes
    cases = [] if matrix.hosts or matrix.control else (matrix.cases or (straggler_cases(matrix, world) if
                                                                        matrix.stragglers else product(matrix, world, per_node)))
    refs: dict[str, dict] = {}
    rows = hosts_mode(matrix, data, run_dir) if matrix.hosts else control_mode(matrix, data, run_dir) \
        if matrix.control else []
    for i, case in enumerate(cases):
        framework, faults = parse_case(case)
        slow = any(f.slowdown for f in faults)
        job = job_of(straggler_data(data, matrix) if slow else data, framework, one_stage=slow)
        if (framework, slow) not in refs:
            ref_dir = os.path.join(run_dir, f"uninterrupted-{framework}{'-straggler' if slow else ''}")
            code, tail = run_job(job, ref_dir, 0, matrix.case_timeout_s)
            refs[framework, slow] = ranks_of(ref_dir)
            if code != 0 or sorted(refs[framework, slow]) != list(range(world)):
                sys.exit(f"fault_matrix: the uninterrupted {framework} run failed (exit {code}):\n{tail}")
        out_dir = os.path.join(run_dir, f"case{i:03d}")
        t0 = time.monotonic()
        code, tail = run_job(job, out_dir, matrix.spares, matrix.case_timeout_s, faults=[str(f) for f in faults])
        ranks = ranks_of(out_dir)
        row = classify(code, tail, ranks, refs[framework, slow], world)
        if slow:
            row = handed_over(row, ranks)
        kind, phase, rank = describe(faults, world)
        row = {"case": case, "fault": kind, "phase": phase, "rank": rank, "framework": framework, **row,
               "seconds": time.monotonic() - t0, "exit_code": code, "dir": out_dir}
        rows.append(row)
        print(f"[{i + 1}/{len(cases)}] {case}: {row['outcome']} (lost {row['lost_iterations']}, "
              f"recovery {row['recovery_s']}, {row['seconds']:.1f} s) {row['note']}", flush=True)
    outcomes = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    recovered = [r for r in rows if r["outcome"] in ("recovered", "fell_back")]
    summary = {"cases": len(rows), "outcomes": outcomes,
               "all_acceptable": all(r["outcome"] in ACCEPTABLE for r in rows),
               "max_lost_iterations": max((r["lost_iterations"] for r in recovered), default=0),
               "recovered_bitwise": all(r["bitwise_identical"] for r in recovered)}
    report = {"rows": rows, "summary": summary, "fault_step": matrix.fault_step, "steps": matrix.train.steps,
              "spares_per_node": matrix.spares, "num_ranks": world, "seconds": time.monotonic() - t_start,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python recipes/fault_matrix.py " + " ".join(HydraConfig.get().overrides.task)}
    with open(matrix.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    if matrix.docs:
        write_table(matrix.docs, report)
    print(json.dumps(summary))
    print(f"wrote {os.path.abspath(matrix.out)}" + (f" and {matrix.docs}" if matrix.docs else ""))
    if not summary["all_acceptable"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
