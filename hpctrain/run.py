"""What every rank runs: `python -m hpctrain.run <run_dir>`.

The run directory's config.yaml is the single source of truth; the launcher (local, srun,
torchrun, mpiexec) only decides how many of us there are and where rank 0 listens.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from hpctrain.core import faults
from hpctrain.core.compose import load
from hpctrain.distributed import nccl
from hpctrain.distributed.bootstrap import BootstrapError, detect, init
from hpctrain.core.rundir import ECHOES, attempt_dir, layout_problem
from hpctrain.core import rules
from hpctrain.core.spec import backend_for, engine_spec
from hpctrain.train.preempt import Preemption

log = logging.getLogger("hpctrain")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m hpctrain.run <run_dir>\nWhat every rank runs, started by a launcher (local, srun, "
             "torchrun, mpiexec) on a run directory hpctrain prepared; to train: python -m hpctrain [overrides]")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    # A rank that dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT leaves every thread's Python stack
    # in its log (and the native one where Python can, 3.14 on).
    faulthandler.enable(file=sys.stderr, all_threads=True, **({"c_stack": True} if sys.version_info >= (3, 14) else {}))
    # First thing: a preemption signal may come while torch is still importing (seconds).
    preemption = Preemption().install()
    run_dir = Path(argv[0]).resolve()
    cfg = load(run_dir / "config.yaml")
    de = detect()
    logging.basicConfig(level=logging.INFO, format=f"[rank {de.rank}] %(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if de.note:
        log.warning(de.note)
    problem = layout_problem(run_dir)  # started without the supervisor's check (torchrun, mpiexec)
    if problem:
        log.error("%s", problem)
        return 2
    if de.launcher == "agent":  # forked by a node agent: generations in this process
        return generations(run_dir, preemption)
    spec = engine_spec(cfg, de.world)
    refused = rules.problems(spec)  # the login node's rule book, for a start it did not check (torchrun, mpiexec)
    if refused:
        log.error("the config cannot run on the %d ranks %s started: %s", de.world, de.launcher,
                  "; ".join(p.message for p in refused))
        return 2

    # torch (also imported by the modules below) takes seconds: only after the preemption handler
    import torch
    import torch.distributed as dist

    from hpctrain.checkpoint.manager import NoUsableCheckpoint, SaveFailed
    from hpctrain.distributed import health
    from hpctrain.train.loop import Trainer
    from hpctrain.train.watchdog import Watchdog

    adir = attempt_dir(run_dir, faults.attempt())
    adir.mkdir(parents=True, exist_ok=True)
    watchdog = None
    try:
        backend = backend_for(cfg.launcher.backend, spec.device, torch.cuda.is_available())
        nccl.apply(backend, {k: str(v) for k, v in cfg.cluster.env.items()}, de.rank,
                   dump_prefix=str(adir / "nccl-trace-rank-"))
        device = init(de, backend, cfg.launcher.timeout_s, cfg.train.threads)
        log.info("rank %d of %d on %s (launcher %s, backend %s, device %s, attempt %d)", de.rank, de.world,
                 socket.gethostname(), de.launcher, backend, device, faults.attempt())
        where_ranks_run(adir)
        watchdog = Watchdog(adir, de.rank, cfg.launcher.hang_timeout_s, cfg.launcher.timeout_s,
                            groups=lambda: {"world": dist.group.WORLD}).start()
        if cfg.launcher.health.enabled:
            watchdog.beat(0, "health")
            if not health.check(adir, device, cfg.launcher.health.slowdown).ok:
                return health.EXIT_UNHEALTHY
        outcome = Trainer(spec, str(run_dir), device).fit(preemption, watchdog)
        if de.rank == 0:
            log.info("%s at step %d", outcome.status, outcome.step)
    except (BootstrapError, NoUsableCheckpoint, SaveFailed) as e:
        log.error("%s", e)
        report_error(adir, de.rank, e)
        return 2
    except KeyboardInterrupt as e:  # a second SIGINT (hpctrain.train.preempt): stop now, as asked
        report_error(adir, de.rank, e)
        log.error("stopped at once by a second SIGINT (Ctrl-C), without saving")
        return 130
    except BaseException as e:  # DCP raises BaseException subclasses; log them all, then fail the rank
        report_error(adir, de.rank, e)
        if is_echo(e):
            # A peer's death seen from here: a page of gloo traceback would bury the supervisor's verdict
            # (which rank failed first, and why) that follows it.
            log.error("a collective failed because a peer rank went away (%s); the supervisor names the rank "
                      "that failed first. This rank's traceback: %s", first_line(e),
                      adir / f"error-rank-{de.rank}.json")
        else:
            traceback.print_exc()
        return 1
    finally:
        if watchdog is not None:
            watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def generations(run_dir: Path, preemption: Preemption) -> int:
    """A rank started by a node agent (checkpoint.memory_every > 0): train in generation after
    generation, in this process, until the run ends or the supervisor replaces this rank
    (hpctrain.distributed.generation). The health check runs once, in the process's first generation."""
    import torch
    import torch.distributed as dist

    from hpctrain.checkpoint.manager import NoUsableCheckpoint, SaveFailed
    from hpctrain.core import generations as plans
    from hpctrain.distributed import generation as gen
    from hpctrain.distributed import health
    from hpctrain.train.loop import Trainer
    from hpctrain.train.watchdog import Watchdog

    first = True
    while True:
        g = faults.attempt()
        cfg = load(run_dir / "config.yaml")  # the supervisor may have re-planned it for fewer nodes
        de = detect()
        adir = attempt_dir(run_dir, g)
        adir.mkdir(parents=True, exist_ok=True)
        spec = engine_spec(cfg, de.world)
        trainer = watchdog = None
        step = None
        try:
            backend = backend_for(cfg.launcher.backend, spec.device, torch.cuda.is_available())
            if backend == "nccl":  # no tested abort of a NCCL communicator yet: every rank restarts
                cfg.launcher.in_process = False
            nccl.apply(backend, {k: str(v) for k, v in cfg.cluster.env.items()}, de.rank,
                       dump_prefix=str(adir / "nccl-trace-rank-"))
            device = init(de, backend, cfg.launcher.timeout_s, cfg.train.threads)
            log.info("rank %d of %d on %s (generation %d%s)", de.rank, de.world, socket.gethostname(), g,
                     "" if first else ", in the same process")
            where_ranks_run(adir)
            # The watchdog stays the backstop for a rank stuck outside collectives, at twice the hang
            # timeout: the collectives' own timeout (gen.ArmingWatchdog) frees the survivors first.
            watchdog = Watchdog(adir, de.rank, cfg.launcher.hang_timeout_s, cfg.launcher.timeout_s,
                                groups=lambda: {"world": dist.group.WORLD}, scale=2.0).start()
            # A collective of every rank: only in a generation where every rank is new (survivors do
            # not run it again, and a rank forked to join them would wait in it alone).
            plan = plans.read_plan(run_dir, g) or {}
            if first and not plan.get("survivors") and cfg.launcher.health.enabled:
                watchdog.beat(0, "health")
                if not health.check(adir, device, cfg.launcher.health.slowdown).ok:
                    return health.EXIT_UNHEALTHY
            first = False
            trainer = Trainer(spec, str(run_dir), device)
            if not preemption._previous:  # a failed generation's fit uninstalled it; a signal still counts
                preemption.install()
            armed = gen.ArmingWatchdog(watchdog, cfg.launcher.hang_timeout_s, keep=lambda: [getattr(trainer.ckpt, "_pg", None)])
            outcome = trainer.fit(preemption, armed)
            if de.rank == 0:
                log.info("%s at step %d", outcome.status, outcome.step)
            return 0
        except (BootstrapError, NoUsableCheckpoint, SaveFailed) as e:
            log.error("%s", e)
            report_error(adir, de.rank, e)
            return 2
        except KeyboardInterrupt as e:
            report_error(adir, de.rank, e)
            log.error("stopped at once by a second SIGINT (Ctrl-C), without saving")
            return 130
        except BaseException as e:  # noqa: BLE001 - reported, then this rank waits for the next generation
            step = getattr(trainer, "step", None)
            if gen.is_timeout(e):
                gen.hang_report(adir, de.rank, e, step)
                log.error("a collective timed out at step %s (a peer made no progress): waiting for the "
                          "supervisor's next generation", step)
            else:
                report_error(adir, de.rank, e)
                if is_echo(e):
                    log.error("a collective failed because a peer rank went away (%s): waiting for the "
                              "supervisor's next generation", first_line(e))
                else:
                    traceback.print_exc()
            if not cfg.launcher.in_process:
                return 1
        finally:
            if watchdog is not None:
                watchdog.stop()
        gen.teardown(trainer)
        del trainer
        gen.say_waiting(adir, de.rank)  # only now may the supervisor keep this rank for the next generation
        nxt = plans.wait_next(run_dir, g, de.rank, cfg.launcher.timeout_s)
        if nxt is None:
            log.error("no next generation keeps this rank: ending")
            return 1
        os.environ.update(plans.rank_env(plans.read_plan(run_dir, nxt), de.rank))


def where_ranks_run(adir: Path) -> None:
    """<attempt dir>/ranks.json: the host and process id of every rank (the supervisor names nodes
    with it; a person, or a test, finds a rank's process)."""
    # torch: imported by main() once the preemption handler is in place
    import torch.distributed as dist

    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), os.getpid()))
    if dist.get_rank() == 0:
        (adir / "ranks.json").write_text(json.dumps({"hosts": {str(r): h for r, (h, _) in enumerate(where)},
                                                     "pids": {str(r): p for r, (_, p) in enumerate(where)}}))


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"[:500]


def is_echo(error: BaseException) -> bool:
    """An error this rank raised because a peer died (a broken connection in a collective)."""
    return any(e in str(error) for e in ECHOES)


def report_error(adir: Path, rank: int, error: BaseException) -> None:
    """<attempt dir>/error-rank-R.json: what ended this rank, for the supervisor (and a person: the
    whole traceback)."""
    report = {"rank": rank, "host": socket.gethostname(), "time": time.time(), "error": first_line(error),
              "traceback": traceback.format_exception(error)}
    try:
        (adir / f"error-rank-{rank}.json").write_text(json.dumps(report))
    except OSError:
        pass


def exit_now(code: int) -> None:
    """Leave without running interpreter finalization: C++ threads of the process group (gloo,
    TCPStore) can still be alive then, and tearing down their objects aborts the process
    ("terminate called without an active exception") after the work is done."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> int:
    """main(), where a SIGINT that comes after training (the handler of hpctrain.train.preempt is gone
    then) ends the rank quietly: the person asked it to stop, a traceback would say it failed."""
    try:
        return main()
    except KeyboardInterrupt:
        print("hpctrain: stopped by SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    exit_now(entry())
