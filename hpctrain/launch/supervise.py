"""`python -m hpctrain.launch.supervise <run_dir>`: start every rank of a run, and when any fails,
start them all again from the newest complete checkpoint, inside the same allocation.

It runs where the job's batch script runs (launcher=sbatch and slurm: the first node of the
allocation; launcher=local: the login shell), as one process that imports no torch. Per start
("attempt" N, counted over the whole run, requeues included):

1. the ranks start (one srun step, or local processes) with HPCTRAIN_ATTEMPT=N; every rank runs the
   health check, then trains, its watchdog failing it when the step makes no progress;
2. all ended well: done; all saved after a preemption signal: requeue the job (Slurm) and stop;
3. otherwise the cause is worked out (hpctrain.launch.failures) from what the ranks left in
   <run.dir>/attempts/N/ and from which nodes still answer, and recorded in interruptions.jsonl;
   unhealthy and lost nodes are left out, and the run continues on the others with a layout the
   planner accepts for the smaller world (hpctrain.plan.elastic), or, below launcher.min_nodes, the
   job is requeued without them (Slurm's ExcNodeList);
4. at most launcher.max_restarts times; a failure identical to the previous one (same cause, ranks,
   nodes and message: a bug or a bad input, not bad luck) stops the run at once, with the failing
   rank, its node and the tail of its log.

Why our own and not torchrun's elastic agent: the agent restarts workers on a failure, but it knows
nothing of hangs, cannot leave out a node or re-plan the layout for a smaller world, and loses its
rendezvous when the node hosting it dies; Slurm can run a new step on the remaining nodes of an
allocation kept alive with --no-kill, and requeue a job without a node. Both are used here.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from hpctrain.checks.config_checks import check
from hpctrain.core.compose import ConfigError, load, to_yaml
from hpctrain.launch import chain, requeue as slurm_requeue, summary
from hpctrain.plan.elastic import shrink_to_fit
from hpctrain.launch.failures import Failure, classify, read_reports
from hpctrain.core.rundir import (ATTEMPTS, INTERRUPTIONS, STALE_S, STOPPED, RunLock, append_jsonl, attempt_dir,
                             check_run_dir, clear_outcome, layout_problem, list_complete, read_jsonl, read_outcome,
                             write_atomic, write_jsonl)
from hpctrain.core.spec import world_size
from hpctrain.launch.runners import AgentRunner, LocalRunner, SrunRunner


# How long the job's supervisor waits for a holder of the run's lock that may be gone: the job's own
# earlier start (before a requeue), whose lock NFS keeps until the server's lease runs out (NFSv4: 90 s
# by default) where its node was lost; a holder on another node seen only by its record, until its
# heartbeat is STALE_S old.
HOLDER_WAIT_S = STALE_S + 60.0


def say(msg: str) -> None:
    print(f"hpctrain: {msg}", file=sys.stderr, flush=True)


def completed_message(run_dir: Path, step: int) -> str:
    """What to do instead of rerunning a finished run."""
    msg = (f"the run already completed at step {step}: nothing to do. To train from scratch, give a new "
           f"run.dir (run.dir={run_dir}-2)")
    if list_complete(run_dir / "checkpoints"):
        msg += f"; to train this one further from its last checkpoint, raise train.steps above {step}"
    return msg


class Supervisor:
    def __init__(self, run_dir: Path, runner, slurm: bool):
        self.run_dir, self.runner, self.slurm = Path(run_dir), runner, slurm
        self.cfg = load(self.run_dir / "config.yaml")
        self.excluded: list[str] = []
        self.stopping = 0  # the signal a person (or scancel) sent the supervisor, or 0
        self.attempt = 0  # the start running now
        self._polled = 0.0

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        done = read_outcome(self.run_dir) or {}
        if done.get("status") == "completed" and int(done.get("step", -1)) >= self.cfg.train.steps:
            # A later link of a chain (or a rerun) on a finished run: nothing to train.
            say(completed_message(self.run_dir, int(done["step"])))
            self._end_chain()
            return 0
        attempt = self._next_attempt()
        restarts, last = 0, None
        limit = self.cfg.launcher.max_restarts
        while True:
            # The interruption recorded last (here, or before a requeue) ends with this start.
            self._restarted(time.time())
            problem = self._recheck()
            if problem:
                say(f"error: {problem}")
                return 2
            nodes = self._nodes()
            if nodes is None:
                return 1
            if self.stopping:  # a Ctrl-C (or scancel) between starts: no new one
                say(f"stopped by {signal.Signals(self.stopping).name} before start {attempt}; {self._again()}")
                self._summary("stopped")
                return 130
            self._replaced(nodes)
            clear_outcome(self.run_dir)
            self.attempt = attempt
            started = time.time()
            say(f"start {attempt}: {len(nodes)} node(s) ({', '.join(nodes)}), {world_size(self.cfg)} ranks")
            ended = self.runner.start(attempt, nodes, {"HPCTRAIN_ATTEMPT": str(attempt)}, self._poll)
            append_jsonl(self.run_dir / "attempts.jsonl", {"attempt": attempt, "nodes": nodes, "start": started,
                                                            "end": time.time(), "rc": ended.rc,
                                                            "world": world_size(self.cfg)})
            outcome = read_outcome(self.run_dir) or {}
            if ended.rc == 0 and outcome.get("status") == "completed":
                self._poll(force=True)
                say(f"completed at step {outcome.get('step')}")
                self._summary()
                self._end_chain()
                return 0
            stop = ended.interrupted or self.stopping
            if ended.rc == 0 and outcome.get("status") == "preempted":
                return self._preempted(outcome, attempt, stop)
            if ended.rc == 0 and outcome.get("status") == "nonfinite":
                # A restart from the same checkpoint with the same config goes non-finite again.
                at = (outcome.get("nonfinite") or {}).get("step")
                say(f"the loss or gradient norm went non-finite at step {at}: stopped, not restarting "
                    "(train.on_nonfinite)")
                self._summary()
                self._end_chain()
                return 1
            if stop:
                how = ("a second Ctrl-C (SIGINT) to the launcher: stopped at once, without saving"
                       if ended.stopped_now else
                       f"{signal.Signals(stop).name} to the launcher: stopped without saving")
                self._record(Failure(STOPPED, detail=how, failed_at=time.time()), attempt)
                say(f"stopped by a signal: not restarting; {self._again()}")
                self._summary("stopped")
                return 130 if ended.stopped_now else (ended.rc or 130)
            failure = self._classify(attempt, nodes, ended)
            self._record(failure, attempt)
            blame = getattr(self.runner, "blame", None)
            if blame is not None:  # node agents: the blamed ranks are not kept for the next generation
                blame(failure.ranks)
            if failure.cause in ("unhealthy", "node_lost"):
                self.excluded += [n for n in failure.nodes if n not in self.excluded]
            if last is not None and failure.signature() == last.signature():
                return self._give_up(failure, f"the run failed the same way twice in a row ({failure.cause})")
            if restarts >= limit:
                return self._give_up(failure, f"{restarts} restart(s) used up (launcher.max_restarts={limit})")
            last, restarts, attempt = failure, restarts + 1, attempt + 1
            source = "memory snapshot or checkpoint" if isinstance(self.runner, AgentRunner) else "checkpoint"
            say(f"restart {restarts} of at most {limit} from the newest complete {source}")

    def _recheck(self) -> str | None:
        """config.yaml again, with every login-node check, and the run directory's layout, before each
        start: someone may have edited them since the run was submitted (or since the last start), and a
        bad value is cheaper to name here than as a crash on every rank."""
        path = self.run_dir / "config.yaml"
        try:
            self.cfg = load(path)
            check(self.cfg)
        except ConfigError as e:
            return f"{path} {str(e).removeprefix(f'{path}: ')}. Fix the file, then run the same command again"
        return layout_problem(self.run_dir)  # a file put where the ranks keep theirs fails every one of them

    def _nodes(self) -> list[str] | None:
        """The nodes of the next start, the config re-planned when nodes were left out."""
        nodes = [n for n in self.runner.nodes() if n not in self.excluded]
        if not self.slurm:
            if self.excluded:
                say(f"this machine was found unusable ({', '.join(self.excluded)}): nothing to continue on")
                return None
            return nodes
        want = self.cfg.cluster.nodes
        if len(nodes) >= want:
            return keep_places(self._last_nodes(), nodes, want)
        try:
            cfg, n, change = shrink_to_fit(self.cfg, len(nodes), self.cfg.launcher.min_nodes)
        except ConfigError as e:
            return self._requeue_without(str(e))
        self.cfg = cfg
        write_atomic(self.run_dir / "config.yaml", to_yaml(cfg))
        say(f"continuing on {n} node(s) without {', '.join(self.excluded)}: {change}")
        return nodes[:n]

    def _requeue_without(self, why: str) -> None:
        say(f"cannot go on with the nodes left ({why})")
        if slurm_requeue.exclude_nodes(os.environ, self.excluded) and \
                slurm_requeue.requeue(os.environ, self.cfg.cluster.max_requeues):
            say(f"requeued without {', '.join(self.excluded)}: the job resumes from the newest checkpoint")
        return None

    def _preempted(self, outcome: dict, attempt: int, stop: int) -> int:
        # A person's Ctrl-C is not a preemption: goodput does not charge the time until they go on.
        cause = STOPPED if stop == signal.SIGINT else "preempted"
        how = "Ctrl-C (SIGINT) to the launcher: " if cause == STOPPED else ""
        self._record(Failure(cause, detail=f"{how}saved at step {outcome.get('step')}", failed_at=time.time()),
                     attempt)
        later = chain.later_links(chain.read_chain(self.run_dir), os.environ) if self.slurm else []
        if later:  # the next link of the chain goes on from this save
            say(f"saved at step {outcome.get('step')}; the next link of the chain (job {later[0]}) continues the run")
        elif self.slurm:
            slurm_requeue.requeue(os.environ, self.cfg.cluster.max_requeues)
        else:
            say(f"stopped at step {outcome['step']} and saved {outcome.get('checkpoint')}; "
                "run the same command again to resume")
            self._summary()
        return 0

    def _end_chain(self) -> None:
        later = chain.later_links(chain.read_chain(self.run_dir), os.environ) if self.slurm else []
        if later and chain.cancel(later):
            say(f"the run is complete: cancelled the rest of the chain ({', '.join(later)})")

    def _give_up(self, failure: Failure, why: str) -> int:
        rank = failure.ranks[0] if failure.ranks else None
        where = f"rank {rank}" + (f" on {failure.nodes[0]}" if failure.nodes else "") if rank is not None else \
            ", ".join(failure.nodes)
        msg = f"{why}; not restarting. Last failure: {failure.detail}"
        if rank is not None:
            path, text = self.runner.log_tail(rank)
            msg += f"\n--- {where}, its log: {path} ---\n{text}" if text else f" ({where}; its log: {path})"
        print(f"hpctrain: error: {msg}", file=sys.stderr, flush=True)
        self._summary("failed")
        return 1

    def _again(self) -> str:
        """What running the same command again does: resume, or (nothing saved yet) start over."""
        if list_complete(self.run_dir / "checkpoints"):
            return "run the same command again to resume"
        return "nothing was saved yet: the same command starts again from step 1"

    def _summary(self, ended_as: str | None = None) -> None:
        """What the run leaves, as it ends here (hpctrain.launch.summary), also into outcome.json (written
        with `ended_as` as its status where no rank wrote one: a run stopped at once or given up). A
        summary that cannot be made never changes how the run ends."""
        try:
            lines = summary.record(self.run_dir, self.cfg, ended_as)
        except Exception as e:  # noqa: BLE001 - the run's end is said above; this is extra
            lines = [f"no summary: {type(e).__name__}: {e}"]
        for line in lines:
            say(line)

    # ------------------------------------------------------------------ records

    def _next_attempt(self) -> int:
        done = [int(p.name) for p in (self.run_dir / ATTEMPTS).glob("*") if p.name.isdigit()]
        return max(done, default=-1) + 1

    def _classify(self, attempt: int, nodes: list[str], ended) -> Failure:
        lost = self.runner.probe(nodes)
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        last_progress = metrics[-1]["time"] if metrics else None
        return classify(read_reports(attempt_dir(self.run_dir, attempt)), ended.failed, world_size(self.cfg),
                        lost, last_progress)

    def _record(self, failure: Failure, attempt: int) -> None:
        now = time.time()
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        good = list_complete(self.run_dir / "checkpoints")
        ckpt = good[-1][0] if good else 0
        last = metrics[-1]["step"] if metrics else 0
        rec = {"time": now, "attempt": attempt, "cause": failure.cause, "ranks": failure.ranks,
               "nodes": failure.nodes, "detail": failure.detail, "checkpoint_step": ckpt, "last_step": last,
               "steps_redone": max(0, last - ckpt), "failed_at": failure.failed_at,
               "detect_s": round(now - failure.failed_at, 2) if failure.failed_at else None,
               "restarted_at": None, "first_step_at": None, "recover_s": None}
        append_jsonl(self.run_dir / INTERRUPTIONS, rec)
        say(f"{failure.cause}: {failure.detail} (last checkpoint step {ckpt}, last step {last})")

    def _restarted(self, when: float) -> None:
        records = read_jsonl(self.run_dir / INTERRUPTIONS)
        if records and records[-1].get("restarted_at") is None:
            records[-1]["restarted_at"] = when
            write_jsonl(self.run_dir / INTERRUPTIONS, records)

    def _last_nodes(self) -> list[str]:
        runs = read_jsonl(self.run_dir / "attempts.jsonl")
        return list(runs[-1].get("nodes", [])) if runs else []

    def _replaced(self, nodes: list[str]) -> None:
        """A start on as many nodes as the last, some of them new: spares that took lost nodes' places
        (cluster.spare_nodes), recorded with the interruption ({"n2": "n3"})."""
        runs = read_jsonl(self.run_dir / "attempts.jsonl")
        records = read_jsonl(self.run_dir / INTERRUPTIONS)
        if not runs or not records or records[-1].get("replaced") is not None:
            return
        before = list(runs[-1].get("nodes", []))
        if len(before) != len(nodes) or before == nodes:
            return
        replaced = {old: new for old, new in zip(before, nodes) if old != new}
        records[-1]["replaced"] = replaced
        write_jsonl(self.run_dir / INTERRUPTIONS, records)
        say("replacing " + ", ".join(f"{o} with the spare {n}" for o, n in replaced.items()) + " in this job")

    def _restored(self, rec: dict) -> None:
        """What the ranks of the start after an interruption restored (attempts/<N>/restored.json,
        written by rank 0): from memory, the steps redone count from the snapshot, not the disk checkpoint."""
        try:
            got = json.loads((attempt_dir(self.run_dir, self.attempt) / "restored.json").read_text())
        except (OSError, ValueError):
            return
        rec["restored_from"] = got
        if got.get("kind") == "memory" and isinstance(got.get("step"), int):
            rec["steps_redone"] = max(0, (rec.get("last_step") or 0) - got["step"])
            where = ", ".join(f"rank {r} from the replica on {n}" for r, n in sorted(got.get("source", {}).items())
                              if n != "own")
            say(f"restored step {got['step']} from memory" + (f": {where}" if where else " (every rank its own)"))
        else:
            say(f"restored from disk checkpoint step {got.get('step')}: {got.get('why', '')}")

    def _poll(self, force: bool = False) -> None:
        """While ranks run: the first step after the last interruption ends its recovery time."""
        if not force and time.monotonic() - self._polled < 2.0:
            return
        self._polled = time.monotonic()
        records = read_jsonl(self.run_dir / INTERRUPTIONS)
        if not records or records[-1].get("first_step_at") is not None or records[-1].get("restarted_at") is None:
            return
        rec = records[-1]
        after = [m for m in read_jsonl(self.run_dir / "metrics.jsonl") if m.get("time", 0) > rec["restarted_at"]]
        if after:
            self._restored(rec)
            rec["first_step_at"] = after[0]["time"]
            rec["recover_s"] = round(after[0]["time"] - (rec["failed_at"] or rec["time"]), 2)
            write_jsonl(self.run_dir / INTERRUPTIONS, records)

    def interrupt(self, signum, _frame) -> None:
        self.stopping = self.stopping or signum
        forward = getattr(self.runner, "forward", None)
        if forward is not None:
            forward(signum)


def keep_places(last: list[str], usable: list[str], want: int) -> list[str]:
    """The `want` nodes of the next start: the last start's in their places where still usable, a lost
    one's place taken by the next unused node (a spare), so that only the lost node's ranks move."""
    if len(last) != want:
        return usable[:want]
    free = [n for n in usable if n not in last]
    out = []
    for n in last:
        if n in usable:
            out.append(n)
        elif free:
            out.append(free.pop(0))
        else:
            return usable[:want]
    return out


def supervise(run_dir: str | os.PathLike, lock: RunLock | None = None) -> int:
    """Drive the run in `run_dir` to its end, holding its lock all along: `lock` where the caller
    took it already (python -m hpctrain, before it wrote config.yaml), else taken here (a Slurm job's
    batch script, and again by the job after a requeue)."""
    logging.basicConfig(level=logging.INFO, format="hpctrain: %(message)s", stream=sys.stderr)
    run_dir = Path(run_dir).resolve()
    try:
        check_run_dir(run_dir)
        cfg = load(run_dir / "config.yaml")
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    slurm = cfg.launcher.name != "local"
    if slurm and "SLURM_JOB_ID" not in os.environ:
        print(f"hpctrain: error: launcher={cfg.launcher.name} runs the supervisor inside a Slurm job "
              "(the batch script does); outside one, use launcher=local", file=sys.stderr)
        return 2
    try:
        held = lock or RunLock.take(run_dir, wait_s=HOLDER_WAIT_S if slurm else 0.0)
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    try:
        if cfg.checkpoint.memory_every > 0:  # node agents, memory snapshots, in-process restarts
            runner = AgentRunner(cfg, run_dir, slurm)
        else:
            runner = SrunRunner(cfg, run_dir) if slurm else LocalRunner(cfg, run_dir)
        sup = Supervisor(run_dir, runner, slurm)
        # scancel, Ctrl-C: no restarts, and no traceback. While local ranks run, the local runner passes
        # signals on to them itself (hpctrain.launch.local); here they count between its starts.
        previous = {s: signal.signal(s, sup.interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return sup.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            close = getattr(runner, "close", None)
            if close is not None:
                close()
    finally:
        if lock is None:
            held.release()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m hpctrain.launch.supervise <run_dir>\nStarts every rank of a prepared run and "
             "restarts them from the newest checkpoint when one fails (what a Slurm job runs); to train: "
             "python -m hpctrain [overrides]")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    return supervise(argv[0])


if __name__ == "__main__":
    sys.exit(main())
