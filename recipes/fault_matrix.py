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
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_job  # noqa: E402
from hotspare.config import ConfigError, from_mapping  # noqa: E402
from hotspare.launch import ABORT_EXIT_CODE  # noqa: E402
from hotspare.testing import faults as catalogue  # noqa: E402

FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
HOST_FAULTS = ("cut", "slow", "node", "blip", "launcher0", "launcher1")
SLOW_MBIT = 20.0
"""The slow link's rate: a step's collectives and mirror copy take about a second on it."""
TARGETS = ("first", "middle", "last", "spare")
OUTCOMES = ("recovered", "fell_back", "stopped_cleanly", "unaffected", "wrong", "hung", "crashed")
ACCEPTABLE = ("recovered", "fell_back", "stopped_cleanly", "unaffected")
CONTROL_PROBES = ("forged_shutdown", "forged_failure", "forged_kill", "forged_abort", "forged_plan", "forged_alarm",
                  "malformed", "hole", "second_job", "kill_keeper", "kill_launcher")
"""forged_*: a plain TCPStore client writes that message, unsigned, for a live rank; malformed: a
value that is not JSON in each list family (fail, spare, wait, kill); hole: each list's counter
moved with no entry written; second_job: another hotspare-run (another secret) joins as node 1;
kill_keeper: node 0's keeper SIGKILLed; kill_launcher: hotspare-run SIGKILLed (nothing of the job
may be alive 15 s later)."""
RECIPES = os.path.dirname(os.path.abspath(__file__))
MEGATRON_OVERRIDES = os.path.join(RECIPES, "..", "configs", "framework", "megatron.yaml")


@dataclass
class FaultMatrixConfig(gpt_job.GPTJobConfig):
    """The GPT job plus which cases of the matrix to run."""

    out: str = "fault_matrix.json"
    """Where the JSON result goes."""
    frameworks: list[str] = field(default_factory=lambda: list(FRAMEWORKS))
    """Hosts: zero1, zero2, zero3 (DeepSpeed) and megatron (PP=2 x DP=2)."""
    kinds: list[str] = field(default_factory=lambda: list(catalogue.KINDS))
    """Fault kinds (hotspare.testing.faults.KINDS)."""
    phases: list[str] = field(default_factory=lambda: list(catalogue.PHASES))
    """Phases (each kind runs in those of them it applies to)."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """first (rank 0), middle, last, spare (the spare that took a rank)."""
    cases: list[str] = field(default_factory=list)
    """Explicit cases (FRAMEWORK/FAULT[+FAULT...]) instead of the product above."""
    fault_step: int = 3
    """The step the faults strike."""
    spares: int = 2
    """Spares per logical node (a lost node's ranks need the other node's spares)."""
    case_timeout_s: float = 300.0
    """A case still running after this is ``hung`` (its processes are killed)."""
    docs: str = ""
    """Also write the markdown table here (e.g. docs/faults.md); empty: no table."""
    hosts: bool = False
    """Real hosts: each logical node's launcher in a network namespace of its own (its own address,
    a switch between them; needs root and iproute2, skipped with the reason otherwise), and the
    host faults (``host_faults``) instead of the catalogue's."""
    host_faults: list[str] = field(default_factory=lambda: list(HOST_FAULTS))
    """cut (host 1's link down: a partition), slow (host 1's link rate-limited so mirror transfers
    miss the in-flight window, then a rank of it killed), node (every process of host 1 killed),
    blip (host 1's link down for half of ``node_timeout_s``, then back), launcher0 / launcher1
    (SIGKILL of that host's hotspare-run alone: nothing of the job may be alive 15 s later after
    node 0's, and node 1's ranks are replaced like a lost node's after node 1's)."""
    host_fault_after_s: float = 4.0
    """Seconds after training started that the host fault strikes."""
    node_timeout_s: float = 3.0
    """hotspare-run's --node-timeout-s in the hosts mode."""
    control: bool = False
    """The control-plane probes (``control_probes``) instead of the catalogue's faults: what a
    stranger on the store's port, another job or an operator's kill can do to a running job
    (docs/control-plane.md)."""
    control_probes: list[str] = field(default_factory=lambda: list(CONTROL_PROBES))
    """Which control-plane probes to run (CONTROL_PROBES)."""
    control_steps: int = 40
    """Training steps of the control mode's job (long enough for a probe to land mid-run)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, values, allowed in (("frameworks", self.frameworks, FRAMEWORKS), ("kinds", self.kinds, catalogue.KINDS),
                                     ("phases", self.phases, catalogue.PHASES), ("targets", self.targets, TARGETS)):
            for v in values:
                if v not in allowed:
                    raise ConfigError(f"{key}: {v!r} is not one of {', '.join(allowed)}")
        for case in self.cases:
            parse_case(case)
        for p in self.control_probes:
            if p not in CONTROL_PROBES:
                raise ConfigError(f"control_probes: {p!r} is not one of {', '.join(CONTROL_PROBES)}")
        for f in self.host_faults:
            if f not in HOST_FAULTS:
                raise ConfigError(f"host_faults: {f!r} is not one of {', '.join(HOST_FAULTS)}")
        if self.hosts and self.parallel.logical_nodes != 2:
            raise ConfigError(f"hosts=true runs 2 hosts: parallel.logical_nodes must be 2, not "
                              f"{self.parallel.logical_nodes}")
        if self.fault_step < 1 or self.fault_step + 2 > self.train.steps:
            raise ConfigError(f"fault_step={self.fault_step} must be >= 1 and leave two steps after it "
                              f"(train.steps={self.train.steps})")


gpt_job.register()
ConfigStore.instance().store(name="fault_matrix_schema", node=FaultMatrixConfig)


def parse_case(case: str) -> tuple[str, list[catalogue.Fault]]:
    framework, _, faults = case.partition("/")
    if framework not in FRAMEWORKS or not faults:
        raise ConfigError(f"cases: {case!r} must be FRAMEWORK/FAULT[+FAULT...] with FRAMEWORK one of "
                          f"{', '.join(FRAMEWORKS)}")
    try:
        return framework, [catalogue.Fault.parse(f) for f in faults.split("+")]
    except ValueError as exc:
        raise ConfigError(f"cases: {case!r}: {exc}") from None


def target_rank(target: str, world: int) -> int:
    return {"first": 0, "middle": (world - 1) // 2, "last": world - 1, "spare": catalogue.SPARE}[target]


def product(cfg: FaultMatrixConfig, world: int, per_node: int) -> list[str]:
    """Every case of the matrix the config selects, in a fixed order."""
    cases = []
    for framework in cfg.frameworks:
        for kind in cfg.kinds:
            for phase in (p for p in cfg.phases if p in catalogue.PHASES_OF[kind]):
                for target in cfg.targets:
                    rank = target_rank(target, world)
                    faults = [catalogue.Fault(kind, phase, rank, cfg.fault_step)]
                    if rank == catalogue.SPARE or phase == "recovery":
                        # Something else must fail first: a rank of the other logical node (the spare
                        # that takes it is the target's spare, on the node that stays).
                        victim = 1 if rank == catalogue.SPARE else (rank + per_node) % world
                        faults.insert(0, catalogue.Fault("kill", "forward", victim, cfg.fault_step))
                    cases.append(f"{framework}/" + "+".join(str(f) for f in faults))
    return cases


def framework_job(data: dict, framework: str) -> gpt_job.GPTJobConfig:
    job = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(gpt_job.GPTJobConfig)}}
    if framework == "megatron":
        extra = OmegaConf.to_container(OmegaConf.load(MEGATRON_OVERRIDES))
        job = OmegaConf.to_container(OmegaConf.merge(job, extra))
    else:
        job = {**job, "framework": "deepspeed", "zero": {**job["zero"], "stage": int(framework[-1])}}
    return from_mapping(gpt_job.GPTJobConfig, job)


def run_job(job, out_dir: str, spares: int, timeout_s: float, **options) -> tuple[int | None, str]:
    """The job under hotspare-run in a process of its own; (exit code, or None when it was still
    running after ``timeout_s`` and was stopped; the launcher's output, its end)."""
    worker = gpt_job.MEGATRON_WORKER if job.framework == "megatron" else os.path.join(RECIPES, "recovery_worker.py")
    spec = gpt_job.launch_spec(job, out_dir, worker=worker, spares_per_node=spares, mode="hotspare", **options)
    spec.job_id = f"fm{os.getpid()}x{abs(hash(out_dir)) % 10**6}"
    log_path = os.path.join(out_dir, "launcher.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hotspare.launch", *spec.to_argv()], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **spec.extra_env})
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            stop(proc, spec.job_id)
    return code, open(log_path, encoding="utf-8", errors="replace").read()[-4000:]


def stop(proc: subprocess.Popen, job_id: str) -> None:
    """SIGTERM the launcher (it stops its workers and keepers, SIGKILL after its grace period),
    then SIGKILL it and any process of the job still there (a stopped worker, say)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in job_processes(job_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def write_secret(out_dir: str) -> str:
    """A job secret file (owner-only) for the launchers of a job on several nodes."""
    from hotspare.control import auth

    return auth.write_secret_file(os.path.join(out_dir, "job.secret"))


def run_on_hosts(job, out_dir: str, spares: int, timeout_s: float, node_timeout_s: float, fault: str = "",
                 after_s: float = 0.0) -> tuple[int | None, str, dict]:
    """The job on two hosts (network namespaces), one hotspare-run each (``--nnodes 2``); ``fault``
    (cut, slow, node) strikes host 1 ``after_s`` seconds after training started. Returns node 0's
    exit code (None: hung), its output's end, and what happened on host 1."""
    from hotspare.testing.netns import Hosts

    worker = gpt_job.MEGATRON_WORKER if job.framework == "megatron" else os.path.join(RECIPES, "recovery_worker.py")
    base = gpt_job.launch_spec(job, out_dir, worker=worker, spares_per_node=spares, mode="hotspare")
    per_node = job.parallel.num_ranks // 2
    info: dict = {}
    secret_file = write_secret(out_dir)
    with Hosts(2) as hosts:
        procs, logs = [], []
        for i in range(2):
            spec = dataclasses.replace(base, nnodes=2, node_rank=i, nproc_per_node=per_node, logical_nodes=1,
                                       master_addr=hosts.addr(0), master_port=29400, job_id=f"hosts{os.getpid()}",
                                       node_timeout_s=node_timeout_s, job_secret_file=secret_file)
            logs.append(open(os.path.join(out_dir, f"launcher{i}.log"), "w", encoding="utf-8"))
            argv = hosts.run(i, ["env", *[f"{k}={v}" for k, v in spec.extra_env.items()], sys.executable, "-m",
                                 "hotspare.launch", *spec.to_argv()])
            procs.append(subprocess.Popen(argv, stdout=logs[-1], stderr=subprocess.STDOUT))
            if i == 0:
                time.sleep(1.0)  # node 0 opens the store first
        t0 = time.monotonic()
        try:
            if fault:
                events = os.path.join(out_dir, "events")
                while time.monotonic() - t0 < timeout_s and procs[0].poll() is None and not training_started(events):
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
                    job_id = f"hosts{os.getpid()}"
                    info["alive_before"] = len(job_processes(job_id))
                    procs[int(fault[-1])].kill()
                    deadline = time.monotonic() + 15
                    if fault == "launcher0":
                        while job_processes(job_id) and time.monotonic() < deadline:
                            time.sleep(0.2)
                        info["alive_after_15s"] = len(job_processes(job_id))
                    else:  # host 1's own processes: its launcher's workers, spares and keeper
                        while hosts.host_pids(1) and time.monotonic() < deadline:
                            time.sleep(0.2)
                        info["host1_alive_after_15s"] = len(hosts.host_pids(1))
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
                    victim = pid_of(f"hosts{os.getpid()}", f"a{job.parallel.num_ranks - 1}")
                    if victim is not None:
                        os.kill(victim, signal.SIGKILL)
                    time.sleep(after_s)
                    hosts.unslow(1)
            code = procs[0].wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            code = None
        for p in procs[1:]:
            try:
                info["host1_exit"] = p.wait(timeout=node_timeout_s * 4 + 30)
            except subprocess.TimeoutExpired:
                info["host1_exit"] = None
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    if fault == "node":
        # A lost machine's /tmp and /dev/shm go with it; the two hosts here share this machine's,
        # so what host 1's killed keeper left there (its socket, its segments) is discarded.
        from hotspare import keeper

        left = keeper.remove_stale()
        sock = keeper.socket_path(f"hosts{os.getpid()}", 1)
        if os.path.exists(sock):
            os.unlink(sock)
            left.append(os.path.basename(sock))
        info["host1_left"] = left
    tail = open(os.path.join(out_dir, "launcher0.log"), encoding="utf-8", errors="replace").read()[-4000:]
    return code, tail, info


def training_started(events_dir: str) -> bool:
    """Some rank started mirroring (it is past ``initialize``: the job trains)."""
    if not os.path.isdir(events_dir):
        return False
    for name in os.listdir(events_dir):
        with open(os.path.join(events_dir, name), encoding="utf-8") as f:
            if '"kind": "mirror_start"' in f.read():
                return True
    return False


def _count_events(events_dir: str, kind: str) -> int:
    if not os.path.isdir(events_dir):
        return 0
    return sum(f'"kind": "{kind}"' in line for name in os.listdir(events_dir)
               for line in open(os.path.join(events_dir, name), encoding="utf-8"))


def pid_of(job_id: str, worker: str) -> int | None:
    """The process of worker ``worker`` of job ``job_id`` (None when there is none)."""
    import psutil

    for p in psutil.process_iter():
        try:
            e = p.environ()
            if e.get("HOTSPARE_JOB_ID") == job_id and e.get("HOTSPARE_WORKER_ID") == worker:
                return p.pid
        except psutil.Error:
            continue
    return None


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
        job = framework_job(data, framework)
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
            elif fault == "blip" and row["outcome"] == "wrong" and row["bitwise_identical"]:
                row = {**row, "outcome": "unaffected", "note": "the link came back before node 0 gave node 1 up"}
            info["mirror_waits"] = _count_events(os.path.join(out_dir, "events"), "mirror_wait")
            row = {"case": f"hosts/{framework}/{fault}", "fault": f"host_{fault}", "phase": "any",
                   "rank": "host 1", "framework": framework, **row, "seconds": time.monotonic() - t0,
                   "exit_code": code, "dir": out_dir, **info}
            rows.append(row)
            print(f"hosts/{framework}/{fault}: {row['outcome']} (lost {row['lost_iterations']}, recovery "
                  f"{row['recovery_s']}, host 1 exit {info.get('host1_exit')}) {row['note']}", flush=True)
    return rows


def job_processes(job_id: str) -> list[int]:
    """Every live process of job ``job_id``: its workers and spares (by their environment) and its
    keepers (by their command line)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = p.cmdline()
            if p.environ().get("HOTSPARE_JOB_ID") == job_id or \
                    any(a == "--job-id" and b == job_id for a, b in zip(cmd, cmd[1:])):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def keeper_pids(job_id: str) -> list[int]:
    return [p for p in job_processes(job_id) if "hotspare.keeper" in _cmdline(p)]


def _forge(store, probe: str, world: int) -> list[str]:
    """Write ``probe``'s values into the store, unsigned, as a stranger would; the keys written."""
    from hotspare import control
    from hotspare.control import keys

    def entry(counter: str, prefix: str, value: str) -> str:
        key = f"{prefix}{store.add(counter, 1) - 1}"
        store.set(key, value)
        return key

    live = keys.active_id(world - 1)
    if probe == "forged_shutdown":
        store.set(keys.SHUTDOWN, "1")
        return [keys.SHUTDOWN]
    if probe == "forged_failure":
        return [entry(keys.FAIL_COUNT, keys.FAIL, control.messages.to_json(control.Failure(
            worker=live, rank=world - 1, code=-9, reason="exit", wall_time=time.time())))]
    if probe == "forged_kill":
        return [entry(keys.KILL_COUNT, keys.KILL, control.messages.to_json(control.Kill(worker=live)))]
    if probe == "forged_abort":
        store.set(keys.ABORT, "forged: state lost")
        return [keys.ABORT]
    if probe == "forged_plan":
        workers = {str(r): keys.active_id(r) for r in range(world)}
        store.set(keys.plan(1), control.Plan(1, world, workers).to_json())
        return [keys.plan(1)]
    if probe == "forged_alarm":
        names = [keys.alarm(0, keys.active_id(r)) for r in range(world)]
        store.multi_set(names, ["1"] * world)
        return names
    if probe == "malformed":
        return [entry(c, p, "{not json") for c, p in ((keys.FAIL_COUNT, keys.FAIL), (keys.SPARE_COUNT, keys.SPARE),
                                                     (keys.WAIT_COUNT, keys.WAIT), (keys.KILL_COUNT, keys.KILL))]
    if probe == "hole":
        return [f"{p}{store.add(c, 1) - 1}" for c, p in ((keys.FAIL_COUNT, keys.FAIL), (keys.SPARE_COUNT, keys.SPARE),
                                                        (keys.WAIT_COUNT, keys.WAIT), (keys.KILL_COUNT, keys.KILL))]
    raise ValueError(probe)


def control_mode(matrix: FaultMatrixConfig, data: dict, run_dir: str) -> list[dict]:
    """The control-plane probes against the ZeRO 2 job, each in a run of its own, against an
    uninterrupted run: ``unaffected`` (it finished bitwise as if nothing happened, with no
    recovery), or for the kills ``stopped_cleanly`` (no process of the job left 15 s later)."""
    import datetime
    import socket

    import torch.distributed as dist

    world = matrix.parallel.num_ranks
    job = framework_job({**data, "train": {**data["train"], "steps": matrix.control_steps}}, "zero2")
    ref_dir = os.path.join(run_dir, "control-uninterrupted")
    code, tail = run_job(job, ref_dir, 0, matrix.case_timeout_s)
    ref = ranks_of(ref_dir)
    if code != 0 or sorted(ref) != list(range(world)):
        sys.exit(f"fault_matrix: the uninterrupted control-mode run failed (exit {code}):\n{tail}")
    worker = os.path.join(RECIPES, "recovery_worker.py")
    rows = []
    for probe in matrix.control_probes:
        out_dir = os.path.join(run_dir, f"control-{probe}")
        os.makedirs(out_dir, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = gpt_job.launch_spec(job, out_dir, worker=worker, spares_per_node=1, mode="hotspare")
        spec.job_id, spec.master_port = f"cp{os.getpid()}{probe[:6]}", port
        log_path = os.path.join(out_dir, "launcher.log")
        t0 = time.monotonic()
        info: dict = {}
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "hotspare.launch", *spec.to_argv()], stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, **spec.extra_env})
        try:
            events = os.path.join(out_dir, "events")
            while proc.poll() is None and not training_started(events) and time.monotonic() - t0 < matrix.case_timeout_s:
                time.sleep(0.1)
            info["probe_at_s"] = time.monotonic() - t0
            if probe.startswith(("forged", "malformed", "hole")):
                stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
                info["keys"] = _forge(stranger, probe, world)
            elif probe == "second_job":
                secret = write_secret(out_dir)
                intruder = subprocess.run([sys.executable, "-m", "hotspare.launch", "--nnodes", "2", "--node-rank", "1",
                                           "--master-port", str(port), "--job-secret-file", secret, worker],
                                          capture_output=True, text=True, timeout=120)
                info["intruder_exit"] = intruder.returncode
                info["intruder_said"] = intruder.stderr.strip().splitlines()[-1][-300:] if intruder.stderr else ""
            elif probe == "kill_keeper":
                keepers = keeper_pids(spec.job_id)
                info["keeper_killed"] = bool(keepers)
                if keepers:
                    os.kill(keepers[0], signal.SIGKILL)
            elif probe == "kill_launcher":
                alive_before = len(job_processes(spec.job_id))
                proc.kill()
                proc.wait()
                deadline = time.monotonic() + 15
                while job_processes(spec.job_id) and time.monotonic() < deadline:
                    time.sleep(0.2)
                info["alive_after_15s"] = len(job_processes(spec.job_id))
                info["alive_before"] = alive_before
            try:
                code = proc.wait(timeout=max(1.0, matrix.case_timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                code = None
        finally:
            stop(proc, spec.job_id)
        tail = open(log_path, encoding="utf-8", errors="replace").read()
        row = classify(code, tail[-4000:], ranks_of(out_dir), ref, world)
        if probe == "kill_keeper" and not (info.get("keeper_killed") and "the keeper of node" in tail):
            row = {**row, "outcome": "wrong", "note": "no keeper was killed, or its launcher did not say so"}
        elif probe == "kill_launcher":
            clean = info["alive_after_15s"] == 0 and info["alive_before"] > 0
            row = {**row, "outcome": "stopped_cleanly" if clean else "wrong",
                   "note": "nothing of the job alive 15 s after its launcher's SIGKILL" if clean else
                   f"{info['alive_after_15s']} process(es) of the job alive 15 s after its launcher's SIGKILL"}
        elif row["outcome"] == "wrong" and row.get("bitwise_identical") and "no recovery took place" in row["note"]:
            said = "counted in" if probe == "hole" else "not signed"
            named = all(f"control store key {k!r}: {said}" in tail for k in info.get("keys", []))
            refused = probe != "second_job" or (info["intruder_exit"] == 2 and "not signed" in info["intruder_said"])
            row = {**row, "outcome": "unaffected" if named and refused else "wrong",
                   "note": "finished bitwise as if nothing happened" + ("; every forged key named" if info.get("keys")
                                                                         else "") if named and refused else
                   "finished, but a forged key was not named or the intruder was not refused"}
        rows.append({"case": f"control/{probe}", "fault": probe, "phase": "training", "rank": "-",
                     "framework": "zero2", **row, "seconds": time.monotonic() - t0, "exit_code": code,
                     "dir": out_dir, **info})
        print(f"control/{probe}: {rows[-1]['outcome']} {rows[-1]['note']}", flush=True)
    return rows


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def ranks_of(out_dir: str) -> dict[int, dict]:
    out = {}
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        r = json.load(open(path, encoding="utf-8"))
        out[r["rank"]] = r
    return out


def losses(r: dict) -> dict:
    return r.get("losses_hex", r.get("losses", {}))


def classify(code: int | None, tail: str, ranks: dict, ref: dict, world: int) -> dict:
    """Outcome, bitwise equality, lost iterations and recovery time of one case."""
    row = {"bitwise_identical": None, "lost_iterations": None, "recovery_s": None, "note": ""}
    recoveries = [rec for r in ranks.values() for rec in r.get("recoveries", [])]
    if recoveries:
        row["lost_iterations"] = max(int(rec.get("failed_at", rec["version"])) - int(rec["version"])
                                     for rec in recoveries)
        by_generation = {}
        for rec in recoveries:
            by_generation[rec["generation"]] = max(by_generation.get(rec["generation"], 0.0), rec.get("total_s", 0.0))
        row["recovery_s"] = sum(by_generation.values())
    if code is None:
        return {**row, "outcome": "hung", "note": "still running after case_timeout_s"}
    if code != 0:
        clean = code == ABORT_EXIT_CODE or "cannot recover" in tail
        note = next((line for line in reversed(tail.splitlines()) if "cannot recover" in line or "RecoveryError" in line),
                    tail.strip().splitlines()[-1] if tail.strip() else "")
        return {**row, "outcome": "stopped_cleanly" if clean else "crashed", "note": note[-300:]}
    if sorted(ranks) != list(range(world)):
        return {**row, "outcome": "crashed", "note": f"ranks that wrote results: {sorted(ranks)}"}
    identical = all((ranks[r]["fp32_digest"], ranks[r]["optimizer_digest"], ranks[r]["state_digest"]) ==
                    (ref[r]["fp32_digest"], ref[r]["optimizer_digest"], ref[r]["state_digest"])
                    and all(losses(ref[r]).get(k) == v for k, v in losses(ranks[r]).items()) for r in range(world))
    row["bitwise_identical"] = identical
    if not identical:
        return {**row, "outcome": "wrong", "note": "finished, but not bitwise identical to the uninterrupted run"}
    if not recoveries:
        return {**row, "outcome": "wrong", "note": "no recovery took place: the fault did not fire"}
    fell_back = any(rec.get("fallback") for rec in recoveries)
    return {**row, "outcome": "fell_back" if fell_back else "recovered"}


def describe(faults: list[catalogue.Fault], world: int) -> tuple[str, str, str]:
    """(fault, phase, rank label) of a case: its last fault (the first is a trigger, when two)."""
    f = faults[-1]
    label = {0: "first", world - 1: "last", catalogue.SPARE: "spare"}.get(f.rank, "middle")
    return f.kind, f.phase, f"{label} ({'spare' if f.rank == catalogue.SPARE else f.rank})"


def write_table(path: str, report: dict) -> None:
    rows = report["rows"]
    lines = ["# Fault matrix", "",
             "Generated by `recipes/fault_matrix.py` (do not edit by hand): "
             f"`{report['command']}`, {report['date']}, {report['seconds']:.0f} s.", "",
             "Summary: " + ", ".join(f"{k} {v}" for k, v in report["summary"]["outcomes"].items()) +
             f"; every case acceptable: **{report['summary']['all_acceptable']}**; most iterations lost by a "
             f"recovered case: {report['summary']['max_lost_iterations']}.", "",
             "| framework | fault | phase | rank | outcome | bitwise | lost | recovery s | case |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = f"{r['recovery_s']:.2f}" if r["recovery_s"] is not None else "-"
        bit = {True: "yes", False: "NO", None: "-"}[r["bitwise_identical"]]
        lost = "-" if r["lost_iterations"] is None else str(r["lost_iterations"])
        lines.append(f"| {r['framework']} | {r['fault']} | {r['phase']} | {r['rank']} | {r['outcome']} | {bit} | "
                     f"{lost} | {rec} | `{r['case']}` |")
    notes = [r for r in rows if r["note"]]
    if notes:
        lines += ["", "Notes:", ""] + [f"- `{r['case']}`: {r['note']}" for r in notes]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@hydra.main(version_base=None, config_path="../configs", config_name="fault_matrix")
def main(cfg) -> None:
    t_start = time.monotonic()
    data = OmegaConf.to_container(cfg, resolve=True)
    matrix = from_mapping(FaultMatrixConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    world, per_node = matrix.parallel.num_ranks, matrix.parallel.num_ranks // matrix.parallel.logical_nodes
    cases = [] if matrix.hosts or matrix.control else (matrix.cases or product(matrix, world, per_node))
    refs: dict[str, dict] = {}
    rows = hosts_mode(matrix, data, run_dir) if matrix.hosts else control_mode(matrix, data, run_dir) \
        if matrix.control else []
    for i, case in enumerate(cases):
        framework, faults = parse_case(case)
        job = framework_job(data, framework)
        if framework not in refs:
            ref_dir = os.path.join(run_dir, f"uninterrupted-{framework}")
            code, tail = run_job(job, ref_dir, 0, matrix.case_timeout_s)
            refs[framework] = ranks_of(ref_dir)
            if code != 0 or sorted(refs[framework]) != list(range(world)):
                sys.exit(f"fault_matrix: the uninterrupted {framework} run failed (exit {code}):\n{tail}")
        out_dir = os.path.join(run_dir, f"case{i:03d}")
        t0 = time.monotonic()
        code, tail = run_job(job, out_dir, matrix.spares, matrix.case_timeout_s, faults=[str(f) for f in faults])
        row = classify(code, tail, ranks_of(out_dir), refs[framework], world)
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
