"""Every file hpctrain generates for a scheduler comes from a serializer that no value can break.

Random strings from all of Unicode (hypothesis's st.text(), no alphabet restriction) and hostile
examples (U+2028, U+0085, %j, $(...), backticks, quotes, line breaks, NUL) go through every config key
that reaches a generated file: run.dir, run.name, cluster.partition/account/qos/constraint,
cluster.sbatch_extra, cluster.env names and values, cluster.setup, the container image, mounts,
workdir and python, launcher.k8s.node_selector, hpctrain's checkout on PYTHONPATH, a sweep's
directories and a chain's. Each either comes out exactly as given, read back by an independent
reference of what reads it:

- the batch scripts (job.sbatch, a sweep's array script, chain.sh, submitit's script): `bash -n`, then
  bash runs them with stand-ins first on PATH (srun, sbatch, scontrol and the python the script is
  given), which record their argv and environment byte for byte; sbatch's own reading of the
  `#SBATCH` lines (src/sbatch/opt.c: _get_argument, and the scan that stops at the first command);
- srun's and sbatch's --output: Slurm's filename patterns as `man srun` defines them;
- k8s.yaml: yaml.safe_load_all gives exactly the objects, and Kubernetes' $(VAR) expansion of the
  command and env (k8s.io/kubernetes third_party/forked/golang/expansion) gives the values;
- the override a sweep composes each element with: Hydra's own override parser;

or it is refused on the login node by the config check, with a message naming the key and the fix.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from hpctrain.checks import cluster_checks
from hpctrain.checks.config_checks import problems
from hpctrain.checks.k8s_checks import k8s_problems
from hpctrain.core.compose import ConfigError, compose
from hpctrain.launch import chain, container, k8s, multirun, runners
from hpctrain.launch.chain import chain_script
from hpctrain.launch.runners import SrunRunner
from hpctrain.launch.sbatch import sbatch_script
from hpctrain.launch.slurm import executor_parameters

from test_sbatch import no_live_cluster  # noqa: F401 (an autouse fixture: no sinfo asked)

# Subprocess-heavy properties: bounded so that the file stays well under 30 s.
RUNS = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
PURE = settings(RUNS, max_examples=100)

anything = st.text()  # every code point but surrogates, as hypothesis's default
# What the environment or a file system path can hold: every code point but NUL (execve's strings and
# path names end at the first NUL, so no checkout path or PYTHONPATH has one). A NUL in a value that a
# config gives is refused by the checks instead (HOSTILE, the NUL examples).
no_nul = st.text(alphabet=st.characters(exclude_characters="\0"))
short = st.text(max_size=12)
env_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
# Names that steer this test's own machinery (where the stand-ins are found, where they write,
# which array task runs, the dynamic linker), not the serializers.
HARNESS = {"PATH", "SHIM_LOG", "SLURM_ARRAY_TASK_ID"}
env_names = env_name.filter(lambda n: n not in HARNESS and not n.startswith("LD_"))
env_values = st.one_of(anything, st.booleans(), st.integers())
envs = st.dictionaries(env_names, env_values, max_size=4)
# Mostly-valid values next to random ones, so that the random other keys are not refused every time
# for this one alone.
image = st.one_of(st.just("nvcr.io/nvidia/pytorch:24.05-py3"), anything)
run_name = st.one_of(st.just("llama-8b"), anything)
_path_part = r'[^\s,:"$`\\\x00/]{1,12}'  # what a pyxis mount's path can hold (cluster_checks.UNSAFE), but /
mount = st.one_of(st.from_regex(rf"(/{_path_part})+(:(/{_path_part})+(:ro|:ro\+rprivate)?)?", fullmatch=True),
                  anything)

# Hand-picked: every YAML line break, Slurm's patterns, shell expansions, quotes, NUL.
HOSTILE = ["\u2028kind: Pod\u2028", "a\x85b", "\u2029", "%j", "100%", "%%t", "%3t", "$(touch /tmp/pwned)",
           "`id`", "'", '"', "a'b\"c", "\\", "a\\'b", "${HOME}", "$$", "$(HOME)", "#SBATCH --x=1", " -x ", "\t",
           "\ufeff", "\x1b[31m", "\x7f", "é€𝄞", "\n---\nkind: Pod", "a\nb", "a\rb", "a\0b"]

# bash's variables with a behaviour of their own (bash(1), "Shell Variables"): `export NAME=value` does not
# pass `value` on, in bash 5.2 or (BASH_REMATCH) in the 4.4 of older clusters.
BASH_VARIABLES = {"BASHOPTS", "BASHPID", "BASH_ALIASES", "BASH_ARGC", "BASH_ARGV", "BASH_CMDS", "BASH_COMMAND",
                  "BASH_COMPAT", "BASH_LINENO", "BASH_REMATCH", "BASH_SOURCE", "BASH_SUBSHELL", "BASH_VERSINFO",
                  "BASH_XTRACEFD", "DIRSTACK", "EPOCHREALTIME", "EPOCHSECONDS", "EUID", "FUNCNAME", "GROUPS",
                  "HISTCMD", "LINENO", "OPTIND", "PPID", "RANDOM", "SECONDS", "SHELLOPTS", "SRANDOM", "UID", "_"}
BASH_OWN = {"PWD", "SHLVL", "_"}  # what bash puts into its children's environment itself


@functools.lru_cache(maxsize=None)
def _composed(kind: str):
    common = ["+experiment=tiny", "train.micro_batch=4"]
    if kind == "k8s":
        return compose([*common, "launcher=k8s", "cluster.nodes=1", "cluster.tasks_per_node=2",
                        "cluster.container_image=registry.example.com/ml/hpctrain:0.1.0", "run.dir=/tmp/runs/tiny"])
    return compose([*common, f"launcher={kind}", "cluster=local", "run.dir=/runs/tiny"])


def config(kind: str):
    """A composed config (sbatch, slurm or k8s) to change freely: composing costs a second or more."""
    return copy.deepcopy(_composed(kind))


def as_text(value) -> str:
    """cluster.env's value as the job's environment holds it (docs: true/false for booleans)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ------------------------------------------------------------------------- independent references

def slurm_expand(pattern: str, job: str = "42", task: int = 3, array_job: str = "40", array_task: str = "2") -> str:
    """A Slurm filename pattern as `man srun` / `man sbatch` define it ("filename pattern"): %% is a
    %, %j the job id, %t the task's rank, %A and %a the array job and task, an optional width
    between % and the letter; a backslash anywhere turns every pattern off."""
    if "\\" in pattern:
        return pattern
    ids = {"j": job, "t": str(task), "A": array_job, "a": array_task, "J": f"{job}.0", "s": "0", "n": "0",
           "N": "n1", "u": "me", "x": "job"}

    def one(m):
        if m.group(0) == "%%":
            return "%"
        width, letter = m.group(1), m.group(2)
        return ids[letter].zfill(int(width)) if width else ids[letter]

    return re.sub(r"%%|%(\d*)([jtAaJsnNux])", one, pattern)


_C_SPACE = " \t\v\f\r"  # C's isspace() but \n, which ends the line


def sbatch_arguments(rest: str) -> list[str]:
    """What sbatch's parser (_get_argument, src/sbatch/opt.c) takes from the text after `#SBATCH`:
    arguments separated by whitespace outside quotes, quotes removed, a backslash taking the next
    character as it is even inside quotes, an unquoted # ending the line's arguments."""
    args, i, n = [], 0, len(rest)
    while True:
        while i < n and rest[i] in _C_SPACE:
            i += 1
        if i >= n:
            return args
        arg, quote, escaped, comment = [], None, False, False
        while i < n and (quote or rest[i] not in _C_SPACE):
            ch = rest[i]
            i += 1
            if escaped:
                arg.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif quote:
                if ch == quote:
                    quote = None
                else:
                    arg.append(ch)
            elif ch in "'\"":
                quote = ch
            elif ch == "#":
                comment = True
                break
            else:
                arg.append(ch)
        if arg:
            args.append("".join(arg))
        if comment:
            return args


def sbatch_directives(script: str) -> list[tuple[str, object]]:
    """The options sbatch takes from a batch script: every #SBATCH line's arguments, up to the first
    line that is neither blank nor a comment, where it stops reading. Each line of ours must hold one."""
    out = []
    for line in script.split("\n"):
        if line.startswith("#SBATCH"):
            args = sbatch_arguments(line[len("#SBATCH"):])
            assert len(args) == 1 and args[0].startswith("--"), (line, args)
            name, eq, value = args[0][2:].partition("=")
            out.append((name, value if eq else True))
        elif line.strip() and not line.lstrip(_C_SPACE).startswith("#"):
            break
    return out


def k8s_expand(text: str) -> str:
    """Kubernetes' expansion of a container's command and env values (third_party/forked/golang/
    expansion): $$ is a $, $(NAME) the variable's value; here every variable is taken as defined, so
    that any expansion shows."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    out.append(f"<value of {text[i + 2:end]}>")
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


# ----------------------------------------------------------------------------- the stand-ins

SHIM_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
extern char **environ;
/* A stand-in for srun, sbatch, scontrol or python: records its argv and environment byte for byte
   (NUL-separated) as <n>.argv and <n>.env in $SHIM_LOG, n counting the calls; as sbatch it answers
   with a job id (100 + n), as `sbatch --parsable` does or as submitit reads it. */
int main(int argc, char **argv) {
    const char *dir = getenv("SHIM_LOG");
    char path[8192];
    int n = 0, parsable = 0;
    snprintf(path, sizeof path, "%s/count", dir);
    FILE *f = fopen(path, "r");
    if (f) { if (fscanf(f, "%d", &n) != 1) n = 0; fclose(f); }
    n++;
    f = fopen(path, "w"); fprintf(f, "%d", n); fclose(f);
    snprintf(path, sizeof path, "%s/%d.argv", dir, n);
    f = fopen(path, "wb");
    for (int i = 0; i < argc; i++) { fwrite(argv[i], 1, strlen(argv[i]) + 1, f); if (!strcmp(argv[i], "--parsable")) parsable = 1; }
    fclose(f);
    snprintf(path, sizeof path, "%s/%d.env", dir, n);
    f = fopen(path, "wb");
    for (char **e = environ; *e; e++) fwrite(*e, 1, strlen(*e) + 1, f);
    fclose(f);
    const char *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    if (!strcmp(base, "sbatch")) {
        if (parsable) printf("%d;cluster\n", 100 + n); else printf("Submitted batch job %d\n", 100 + n);
    }
    return 0;
}
"""
SHIM_PY = r"""#!{python} -IS
import os, sys
d = os.environb[b"SHIM_LOG"]
count = os.path.join(d, b"count")
n = (int(open(count).read() or 0) if os.path.exists(count) else 0) + 1
open(count, "w").write(str(n))
open(os.path.join(d, b"%d.argv" % n), "wb").write(b"".join(os.fsencode(a) + b"\0" for a in sys.argv))
open(os.path.join(d, b"%d.env" % n), "wb").write(b"".join(k + b"=" + v + b"\0" for k, v in os.environb.items()))
if os.path.basename(sys.argv[0]) == "sbatch":
    print(f"{{100 + n}};cluster" if "--parsable" in sys.argv else f"Submitted batch job {{100 + n}}")
"""
SHIMS = ("srun", "sbatch", "scontrol", "python")


@pytest.fixture(scope="module")
def shim_bin(tmp_path_factory) -> Path:
    """bin/ with the stand-ins: one small C program where a compiler is at hand (a process start of
    a millisecond), else the same in Python."""
    d = tmp_path_factory.mktemp("shims")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    cc = shutil.which("cc") or shutil.which("gcc")
    built = d / "shim"
    if cc:
        (d / "shim.c").write_text(SHIM_C)
        if subprocess.run([cc, "-O1", "-o", str(built), str(d / "shim.c")], capture_output=True).returncode != 0:
            cc = None
    if not cc:
        built.write_text(SHIM_PY.format(python=sys.executable))
    built.chmod(0o755)
    for name in SHIMS:
        os.link(built, bin_dir / name) if cc else shutil.copy(built, bin_dir / name)
    return bin_dir


class Calls:
    """What the stand-ins saw, in order: (name, argv after argv[0], environment), all as str."""

    def __init__(self, log: Path):
        self.log = log

    def __iter__(self):
        count = self.log / "count"
        n = int(count.read_text()) if count.exists() else 0
        for i in range(1, n + 1):
            argv = [os.fsdecode(a) for a in (self.log / f"{i}.argv").read_bytes().split(b"\0")[:-1]]
            env = {}
            for item in (self.log / f"{i}.env").read_bytes().split(b"\0")[:-1]:
                k, _, v = item.partition(b"=")
                env[os.fsdecode(k)] = os.fsdecode(v)
            yield Path(argv[0]).name, argv[1:], env


def run_script(text: str, work: Path, shim_bin: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, list, dict]:
    """`bash -n`, then bash runs the script with the stand-ins first on PATH; returns (process, calls,
    the environment bash was started with)."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "script.sh"
    script.write_bytes(text.encode("utf-8"))
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    log = work / "log"
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir()
    base = {"PATH": f"{shim_bin}:/usr/bin:/bin", "SHIM_LOG": str(log), "HOME": str(work), **(env or {})}
    proc = subprocess.run(["bash", str(script)], env=base, cwd=work, capture_output=True, timeout=60)
    return proc, list(Calls(log)), base


def expected_env(base: dict, cluster_env: dict, pythonpath: str | None = None) -> dict:
    out = dict(base)
    if pythonpath:  # hpctrain's checkout (None, or '' taken alike: installed)
        out["PYTHONPATH"] = pythonpath  # the job started without one: nothing to append
    out.update({str(k): as_text(v) for k, v in cluster_env.items()})
    return out


def same_env(seen: dict, wanted: dict, cluster_env: dict) -> None:
    """The environment a stand-in saw is the one wanted, but for what bash sets itself (where the
    config does not set it)."""
    own = BASH_OWN - {str(k) for k in cluster_env}
    assert {k: v for k, v in seen.items() if k not in own} == {k: v for k, v in wanted.items() if k not in own}


# ------------------------------------------------------------------------------ what is refused

def refused_keys(found: list[str]) -> set[str]:
    """The keys the check's messages name; every message names a fix."""
    keys = set()
    for msg in found:
        assert "Fix:" in msg, msg
        m = re.match(r"cluster\.env has the key '((?:[^'\\]|\\.)*)'", msg)
        keys.add(f"cluster.env name {m.group(1)}" if m else msg.split("=", 1)[0])
    return keys


def sbatch_refusals(values: dict, env: dict, setup: list, run_dir: str, launcher: str = "sbatch") -> set[str]:
    """The keys the config check must refuse, from what sbatch, bash and Slurm cannot carry."""
    out = set()
    for key, value in values.items():
        if value is not None and not isinstance(value, bool) and any(c in str(value) for c in "\n\r\0"):
            out.add(key)
    if "\\" in run_dir:
        out.add("run.dir")  # it turns Slurm's %j in the log's name off
    if launcher == "slurm" and "%" in run_dir:
        out.add("run.dir")  # submitit writes it into a filename pattern unescaped
    for name, value in env.items():
        if name in BASH_VARIABLES or name == "run_dirs":
            out.add(f"cluster.env name {name}")
        if not isinstance(value, bool) and "\0" in str(value):
            out.add(f"cluster.env.{name}")
    for i, line in enumerate(setup):
        if "\0" in line:
            out.add(f"cluster.setup[{i}]")
    return out


# ------------------------------------------------------------------------------- job.sbatch

def sbatch_values(cfg, run_dir: str) -> dict:
    c = cfg.cluster
    return {"run.name": cfg.run.name, "run.dir": run_dir, "cluster.partition": c.partition,
            "cluster.account": c.account, "cluster.qos": c.qos, "cluster.constraint": c.constraint,
            "cluster.sbatch_extra.comment": c.sbatch_extra.get("comment")}


@pytest.mark.slow
@RUNS
@given(run_dir=anything, name=anything, partition=short, account=anything, qos=short, constraint=short,
       comment=anything, env=envs, pythonpath=st.one_of(st.none(), no_nul))
@example(run_dir="/runs/it's $(pwd) `id` 100%j \u2028\x85", name='x"; rm -rf ~; "', partition="p#art",
         account="a\\b", qos="'", constraint="ib&h100", comment="#SBATCH --x", env={"FOO": "$(id)", "B": "\u2028"},
         pythonpath="/src/it's")
@example(run_dir="/runs/a\\b", name="n", partition="p", account="a", qos="q", constraint="c", comment="c",
         env={"RANDOM": "BASH_VERSINFO[$(echo INJECTED >&2)]", "_": "x", "run_dirs": "y"}, pythonpath=None)
@example(run_dir="/runs/a\0", name="a\nb", partition="a\rb", account="a\0b", qos="q", constraint="c",
         comment="c\nd", env={"FOO": "a\0b"}, pythonpath=None)
@example(run_dir="/runs/x", name="n", partition="p", account="a", qos="q", constraint="c", comment="c",
         env={}, pythonpath="\x01")  # a fresh example database once drew '\0' here: not a path (no_nul)
def test_batch_script(tmp_path, shim_bin, run_dir, name, partition, account, qos, constraint, comment, env,
                      pythonpath):
    """job.sbatch: sbatch reads every #SBATCH value as given and its log where run.dir says; bash
    starts the supervisor with exactly the run directory and cluster.env (and the checkout on
    PYTHONPATH); or the check refuses the key with a fix."""
    run_dir = "/" + run_dir
    cfg = config("sbatch")
    cfg.run.name = name
    c = cfg.cluster
    c.partition, c.account, c.qos, c.constraint = partition, account, qos, constraint
    c.sbatch_extra = {"comment": comment}
    c.env = dict(env)
    found = cluster_checks.script_problems(cfg, run_dir)
    want_refused = sbatch_refusals(sbatch_values(cfg, run_dir), env, [], run_dir)
    assert refused_keys(found) == want_refused, found
    event("refused" if found else "written")
    if found:
        with pytest.raises(ConfigError):
            sbatch_script(cfg, run_dir, str(shim_bin / "python"), pythonpath)
        return
    text = sbatch_script(cfg, run_dir, str(shim_bin / "python"), pythonpath)
    opts = dict(sbatch_directives(text))
    assert (opts["job-name"], opts["partition"], opts["account"], opts["qos"], opts["constraint"],
            opts["comment"]) == (name, partition, account, qos, constraint, comment)
    log = str(PurePosixPath(run_dir) / "logs" / "slurm-42.out")  # // and /./ are the same directory
    assert slurm_expand(opts["output"]) == slurm_expand(opts["error"]) == log
    proc, calls, base = run_script(text, tmp_path / "work", shim_bin)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    ((who, argv, seen),) = calls
    assert who == "python" and argv == ["-u", "-m", "hpctrain.launch.supervise", run_dir]
    same_env(seen, expected_env(base, env, pythonpath), env)


@pytest.mark.slow
@RUNS
@given(run_dir=st.one_of(st.just("lustre/runs/x"), anything), image=image,
       workdir=st.one_of(st.just("workspace"), anything), python=st.one_of(st.just("python3"), anything),
       mounts=st.lists(mount, max_size=3))
@example(run_dir="runs/a,b/c d", image="nvcr.io/nvidia/pytorch:24.05-py3", workdir="/w\u2028x",
         python="/usr/bin/python3 $(id)", mounts=["/lustre/data:/data:ro+rprivate", "/a,b", "/x:/y:z:w"])
def test_container_flags(tmp_path, shim_bin, monkeypatch, run_dir, image, workdir, python, mounts):
    """cluster.container_*: the ranks' srun step gets each value as one argument pyxis reads back
    (mounts split at commas and colons into exactly the given ones, then the run directory's), and
    the batch script describes them in comment lines bash never runs; or the check refuses the key."""
    run_dir = "/" + run_dir
    cfg = config("sbatch")
    c = cfg.cluster
    c.container_image, c.container_workdir, c.container_python = image, "/" + workdir, python
    c.container_mounts = list(mounts)
    found = cluster_checks.container_problems(cfg, run_dir, None) + cluster_checks.script_problems(cfg, run_dir)
    event("refused" if found else "written")
    if found:
        for msg in found:
            assert "Fix:" in msg and msg.startswith(("cluster.container_", "run.dir")), msg
        with pytest.raises(ConfigError):
            sbatch_script(cfg, run_dir, str(shim_bin / "python"))
        return
    monkeypatch.setattr(runners, "hostnames", lambda nodelist: ["n1"])
    monkeypatch.setattr(runners, "source_root", lambda: None)
    argv = SrunRunner(cfg, Path(run_dir), env={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1"}).command(["n1"])
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--container-")}
    assert flags["--container-image"] == container.pyxis_image(image)
    assert flags["--container-workdir"] == "/" + workdir
    parsed = [m.split(":") for m in flags["--container-mounts"].split(",")]  # as pyxis reads them
    assert parsed[:len(mounts)] == [m.split(":") for m in mounts]
    point = container.mount_point(run_dir)
    assert parsed[len(mounts):] in ([], [[point, point]])
    assert str(PurePosixPath(run_dir)).startswith(point)
    assert argv[-5:] == [python, "-u", "-m", "hpctrain.run", str(Path(run_dir))]
    # The script only describes them: the supervisor is all it runs.
    text = sbatch_script(cfg, run_dir, str(shim_bin / "python"))
    proc, calls, _ = run_script(text, tmp_path / "work", shim_bin)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert [(who, argv) for who, argv, _ in calls] == [("python", ["-u", "-m", "hpctrain.launch.supervise",
                                                                    run_dir])]


@PURE
@given(run_dir=anything)
@example(run_dir="runs/100%j/%t/%%/%3t")
@example(run_dir="runs/a\\b")
def test_srun_output_is_the_run_directory(monkeypatch, run_dir):
    """srun's --output: each rank's log in <run.dir>/logs, whatever % the path holds (Slurm reads
    the value as a filename pattern); a backslash, which turns the patterns off, is refused."""
    run_dir = "/" + run_dir
    cfg = config("sbatch")
    if "\\" in run_dir or any(c in run_dir for c in "\n\r\0"):
        assert refused_keys(cluster_checks.script_problems(cfg, run_dir)) == {"run.dir"}
        return
    monkeypatch.setattr(runners, "hostnames", lambda nodelist: ["n1", "n2"])
    r = SrunRunner(cfg, Path(run_dir), env={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]"})
    argv = r.command(["n1", "n2"])
    (output,) = [a[len("--output="):] for a in argv if a.startswith("--output=")]
    for rank in (0, 3):
        assert slurm_expand(output, task=rank) == f"{Path(run_dir)}/logs/rank-{rank}.log"
    assert argv[-1] == str(Path(run_dir))


# ------------------------------------------------------------------------------------ sweeps

def element(cfg, env: dict, setup: list[str]):
    out = copy.deepcopy(cfg)
    out.cluster.env = dict(env)
    out.cluster.setup = list(setup)
    return out


@pytest.mark.slow
@RUNS
@given(dirs=st.lists(anything, min_size=1, max_size=3),
       envs_=st.lists(envs, min_size=3, max_size=3), marks=st.lists(anything, min_size=3, max_size=3))
@example(dirs=["/s/optim.lr=0.001", "/s/it's"], envs_=[{"FOO": "a"}, {"FOO": "b"}, {}], marks=["", "", ""])
@example(dirs=["/s/a", "/s/b", "/s/c"], envs_=[{"FOO": "a", "BAR": "x"}, {"FOO": "b"}, {"FOO": "a", "BAR": "x"}],
         marks=["<<EOF", "$(id)", "\u2028"])
def test_array_script_gives_each_task_its_element(tmp_path, shim_bin, dirs, envs_, marks):
    """A sweep's array script: task i starts the supervisor of element i's run directory with element
    i's own cluster.env, after element i's own cluster.setup (FOO=a in task 0, FOO=b in task 1), and
    a task id outside the sweep starts nothing."""
    n = len(dirs)
    dirs = ["/" + d for d in dirs]
    base = config("sbatch")
    # setup is the user's own shell: a line that records which element's setup ran, by its index
    setups = [[f"SETUP_RAN={shlex.quote(f'{i}:{marks[i]}')}", "export SETUP_RAN"] for i in range(n)]
    cfgs = [element(base, envs_[i], setups[i]) for i in range(n)]
    found = [p for i, c in enumerate(cfgs) for p in cluster_checks.script_problems(c, dirs[i])]
    event("refused" if found else "written")
    if found:
        assert refused_keys(found) == set().union(*(sbatch_refusals({"run.dir": d}, e, s, d)
                                                    for d, e, s in zip(dirs, envs_, setups)))
        with pytest.raises(ConfigError):
            sbatch_script(cfgs[0], "/s", str(shim_bin / "python"), array_dirs=dirs, array_cfgs=cfgs)
        return
    text = sbatch_script(cfgs[0], "/s", str(shim_bin / "python"), array_dirs=dirs, array_cfgs=cfgs)
    assert dict(sbatch_directives(text))["array"] == f"0-{n - 1}"
    for i in range(n):
        proc, calls, start = run_script(text, tmp_path / f"task{i}", shim_bin, {"SLURM_ARRAY_TASK_ID": str(i)})
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        ((who, argv, seen),) = calls
        assert argv == ["-u", "-m", "hpctrain.launch.supervise", dirs[i]]
        same_env(seen, expected_env(start, {"SETUP_RAN": f"{i}:{marks[i]}", **envs_[i]}), envs_[i])
    proc, calls, _ = run_script(text, tmp_path / "outside", shim_bin, {"SLURM_ARRAY_TASK_ID": str(n)})
    assert proc.returncode != 0 and calls == []


def test_sweep_of_one_env_keeps_one_block():
    """Elements that do not differ in setup and env share the script's one block (the array
    snapshot of tests/test_multirun.py); FOO=a,b gives the tasks their own."""
    base = config("sbatch")
    same = sbatch_script(base, "/s", "/py", array_dirs=["/s/a", "/s/b"], array_cfgs=[base, base])
    assert same == sbatch_script(base, "/s", "/py", array_dirs=["/s/a", "/s/b"])
    assert "case " not in same
    a, b = element(base, {"FOO": "a"}, []), element(base, {"FOO": "b"}, [])
    text = sbatch_script(a, "/s", "/py", array_dirs=["/s/a", "/s/b"], array_cfgs=[a, b])
    assert 'case "${SLURM_ARRAY_TASK_ID-}" in\n0)\nexport FOO=a\n;;\n1)\nexport FOO=b\n;;' in text


@pytest.mark.slow
def test_each_task_runs_its_own_setup_as_written(tmp_path, shim_bin):
    """cluster.setup is the user's shell as written, here-documents included (their end marker must
    start its line), in the array script and in submitit's."""
    base = config("sbatch")
    cfgs = [element(base, {}, ["SETUP_RAN=$(cat <<'EOF'", f"setup of element {i}", "EOF", ")", "export SETUP_RAN"])
            for i in range(2)]
    texts = [sbatch_script(cfgs[0], "/s", str(shim_bin / "python"), array_dirs=["/s/a", "/s/b"], array_cfgs=cfgs),
             submitit_script(executor_parameters(cfgs[0], None, array_cfgs=cfgs), "/s/submitit",
                             str(shim_bin / "python"), array=2)]
    for text in texts:
        for i in range(2):
            proc, calls, _ = run_script(text, tmp_path / f"task{i}", shim_bin, {"SLURM_ARRAY_TASK_ID": str(i)})
            assert proc.returncode == 0, proc.stderr.decode(errors="replace")
            ((_, _, seen),) = calls
            assert seen["SETUP_RAN"] == f"setup of element {i}"


@pytest.mark.slow
@RUNS
@given(dirs=st.lists(st.text(min_size=1, max_size=24).filter(lambda s: "/" not in s and "\0" not in s
                                                            and s not in (".", "..") and len(s.encode()) < 200),
                     min_size=1, max_size=3, unique=True),
       links=st.integers(1, 3), array=st.booleans())
@example(dirs=["it's $(id) `x` 100%", "\u2028\x85", "-n"], links=2, array=True)
def test_chain_script(tmp_path, shim_bin, dirs, links, array):
    """chain.sh: sbatch is called `links` times with the script's path as given, each after the
    previous, and chain.json lands in every run directory, however they are named."""
    root = tmp_path / "w"
    shutil.rmtree(root, ignore_errors=True)
    run_dirs = [root / d for d in dirs]
    for d in run_dirs:
        d.mkdir(parents=True)
    script = run_dirs[0] / "job.sbatch"
    text = chain_script(script, links, run_dirs if array else None)
    proc, calls, _ = run_script(text, tmp_path / "work", shim_bin)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    ids = [str(101 + i) for i in range(links)]
    assert [(who, argv) for who, argv, _ in calls] == [
        ("sbatch", ["--parsable", *([f"--dependency=afterany:{ids[i - 1]}"] if i else []), str(script)])
        for i in range(links)]
    for i, d in enumerate(run_dirs if array else [script.parent]):
        assert chain.read_chain(d) == [f"{j}_{i}" if array else j for j in ids]


@PURE
@given(sweep_dir=anything)
@example(sweep_dir="runs/a\\b")
@example(sweep_dir="runs/a\\")
@example(sweep_dir="runs/it's\\'x")
@example(sweep_dir="runs/\u2028,=${x")
def test_element_override_reads_back(sweep_dir):
    """The run.dir override each sweep element is composed with reads back, through Hydra's own
    override parser, as <sweep dir>/<element name>."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweep_dir = "/" + sweep_dir
    e = multirun.Element(0, ["optim.lr=0.001", "train.micro_batch=2"], "optim.lr=0.001,train.micro_batch=2")
    override = multirun.element_overrides(["+experiment=tiny"], e, sweep_dir)[-1]
    assert OverridesParser.create().parse_override(override).value() == str(Path(sweep_dir) / e.name)


# --------------------------------------------------------------------------- submitit (slurm)

def submitit_script(params: dict, folder: str, python: str, array: int = 0) -> str:
    """The batch script submitit 1.5.4 writes for these parameters (its own text), running `python`."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([shlex.quote(python), "-u -m submitit.core._submit", shlex.quote(folder)])
    return _make_sbatch_string(command=command, folder=folder, **params, **({"map_count": array} if array else {}))


@pytest.mark.slow
@RUNS
@given(run_dir=anything, name=anything, account=anything, env=envs, pythonpath=st.one_of(st.none(), no_nul))
@example(run_dir="runs/100%j", name="a\\b", account="x", env={}, pythonpath=None)
@example(run_dir="runs/it's \u2028", name="x\"; `id`", account="$(id)", env={"FOO": "'\\\""}, pythonpath="/a b")
def test_submitit_script(tmp_path, shim_bin, run_dir, name, account, env, pythonpath):
    """launcher=slurm: the script submitit writes from executor_parameters() gives sbatch the values
    as given, and bash starts submitit's python with exactly cluster.env; or the check refuses."""
    run_dir = "/" + run_dir
    cfg = config("slurm")
    cfg.run.name, cfg.cluster.account = name, account
    cfg.cluster.env = dict(env)
    found = cluster_checks.script_problems(cfg, run_dir)
    assert refused_keys(found) == sbatch_refusals(sbatch_values(cfg, run_dir), env, [], run_dir, "slurm"), found
    event("refused" if found else "written")
    if found:
        return
    folder = str(Path(run_dir) / "submitit")  # as submitit holds it (a Path: // and /./ collapse)
    text = submitit_script(executor_parameters(cfg, pythonpath), folder, str(shim_bin / "python"))
    opts = dict(sbatch_directives(text))
    assert (opts["job-name"], opts["account"]) == (name, account)
    assert slurm_expand(opts["output"]) == f"{folder}/42_0_log.out"
    proc, calls, base = run_script(text, tmp_path / "work", shim_bin)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    ((who, argv, seen),) = calls
    assert argv == ["-u", "-m", "submitit.core._submit", folder]
    same_env(seen, expected_env(base, {**env, "SUBMITIT_EXECUTOR": "slurm"}, pythonpath), env)


@pytest.mark.slow
@RUNS
@given(envs_=st.lists(envs, min_size=2, max_size=3))
@example(envs_=[{"FOO": "a"}, {"FOO": "b"}])
def test_submitit_array_gives_each_task_its_element(tmp_path, shim_bin, envs_):
    """launcher=slurm with a sweep: submitit writes one script for the whole array; task i runs with
    element i's cluster.env (FOO=a in task 0, FOO=b in task 1)."""
    base = config("slurm")
    cfgs = [element(base, e, []) for e in envs_]
    refused = any(cluster_checks.script_problems(c, "/s/x") for c in cfgs)
    event("refused" if refused else "written")
    if refused:
        return  # refusals: test_submitit_script
    text = submitit_script(executor_parameters(cfgs[0], None, array_cfgs=cfgs), "/s/submitit",
                           str(shim_bin / "python"), array=len(cfgs))
    for i, e in enumerate(envs_):
        proc, calls, start = run_script(text, tmp_path / f"task{i}", shim_bin, {"SLURM_ARRAY_TASK_ID": str(i)})
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        ((who, argv, seen),) = calls
        same_env(seen, expected_env(start, {**e, "SUBMITIT_EXECUTOR": "slurm"}), e)
    if any(e != envs_[0] for e in envs_):  # submitit's script has no `set -u` to stop an unknown task
        proc, calls, _ = run_script(text, tmp_path / "outside", shim_bin, {"SLURM_ARRAY_TASK_ID": str(len(envs_))})
        assert proc.returncode != 0 and calls == []


# ---------------------------------------------------------------------- a sweep, end to end

@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["sbatch", "slurm"])
def test_sweep_env_reaches_its_own_task(tmp_path, shim_bin, monkeypatch, capsys, launcher):
    """`python -m hpctrain -m launcher=... +cluster.env.FOO=a,b`: the script the sweep writes (or
    submits through submitit, to a stand-in sbatch) runs task 0 with FOO=a and task 1 with FOO=b."""
    sweep = tmp_path / "sweep"
    log = tmp_path / "submit-log"
    log.mkdir()
    monkeypatch.setattr(sys, "executable", str(shim_bin / "python"))  # the python the job is to run
    monkeypatch.setenv("PATH", f"{shim_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("SHIM_LOG", str(log))
    rc = multirun.multirun(["+experiment=tiny", f"launcher={launcher}", "cluster=local", "train.micro_batch=4",
                            "+cluster.env.FOO=a,b", f"run.dir={sweep}"])
    assert rc == 0, capsys.readouterr()
    if launcher == "sbatch":
        script = sweep / "job.sbatch"
    else:
        ((who, argv, _),) = list(Calls(log))
        assert who == "sbatch"
        script = next((sweep / "submitit").glob("*_submission.sh"))  # where submitit moved it after sbatch
    text = script.read_text()
    for i, foo in enumerate(["a", "b"]):
        proc, calls, _ = run_script(text, tmp_path / f"task{i}", shim_bin, {"SLURM_ARRAY_TASK_ID": str(i)})
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        ((who, argv, seen),) = calls
        assert seen["FOO"] == foo, (i, seen.get("FOO"))
        if launcher == "sbatch":
            assert argv[-1] == str(sweep / f"cluster.env.FOO={foo}")


# ------------------------------------------------------------------------------------ k8s.yaml

@pytest.mark.slow
@RUNS
@given(run_dir=anything, name=run_name, env=envs, image=image, python=anything, workdir=anything,
       selector=st.dictionaries(short, anything, max_size=2))
@example(run_dir="runs/a\u2028---\u2028{kind: Pod, metadata: {name: evil}}\u2028---\u2028#", name="llama",
         env={"NOTE": "costs $(HOME) and $$5", "L": "\u2028\x85\u2029"}, image="r.io/a:b", python="python3",
         workdir="w\x85", selector={"pool": "a\u2029b"})
@example(run_dir="runs/a\0", name="x", env={"F": "a\0b"}, image="r/a\0", python="p", workdir="w", selector={})
def test_k8s_manifest(run_dir, name, env, image, python, workdir, selector):
    """k8s.yaml reads back (yaml.safe_load_all) as exactly the manifest's objects, no more, its header
    only comments; after Kubernetes' $(VAR) expansion the pod's command and env are the values given;
    or the check refuses the key with a fix."""
    run_dir = "/mnt/" + run_dir
    cfg = config("k8s")
    cfg.run.name = name
    c = cfg.cluster
    c.env, c.container_image, c.container_python, c.container_workdir = dict(env), image, python, "/" + workdir
    cfg.launcher.k8s.node_selector = dict(selector)
    found = k8s_problems(cfg, run_dir)
    for msg in found:
        assert "Fix:" in msg, msg
    nul = {k for k, v in {"run.dir": run_dir, "cluster.container_image": image, "cluster.container_python": python,
                          "cluster.container_workdir": workdir,
                          **{f"cluster.env.{k}": v for k, v in env.items()},
                          **{f"launcher.k8s.node_selector.{k}": v for k, v in selector.items()}}.items()
           if "\0" in str(v)}
    for key in nul:
        assert any(msg.startswith(f"{key}=") and "NUL" in msg for msg in found), (key, found)
    event("refused" if found else "written")
    if found:
        with pytest.raises(ConfigError):
            k8s.manifest_text(cfg, run_dir)
        return
    objs = k8s.manifest(cfg, run_dir)
    text = k8s.manifest_text(cfg, run_dir)
    head, _, _ = text.partition("\n---\n")
    assert all(line.startswith("# ") for line in head.split("\n"))
    assert list(yaml.safe_load_all(text)) == objs  # the header: comments, before the first document
    pod = objs[-1]["spec"]["template"]["spec"]
    (box,) = pod["containers"]
    assert [k8s_expand(a) for a in box["command"]][:6] == [python, "-u", "-m", "hpctrain.launch.k8s_pod",
                                                            "--run-dir", run_dir]
    assert k8s_expand(box["command"][-1]) == run_dir
    assert {e["name"]: k8s_expand(e["value"]) for e in box["env"]} == {"PYTHONUNBUFFERED": "1",
                                                                       **{k: as_text(v) for k, v in env.items()}}
    assert box["image"] == image and box["workingDir"] == "/" + workdir
    assert pod.get("nodeSelector", {}) == {k: str(v) for k, v in selector.items()}
    assert box["volumeMounts"][0]["mountPath"] == str(PurePosixPath(run_dir).parent)


@pytest.mark.slow
@RUNS
@given(text=anything.filter(lambda s: "\0" not in s))
@example(text="/runs/a\u2028b\x85c\u2029'$(id)`x`\\")
@example(text="/runs/plain")
def test_shell_word_in_the_manifest_header(text):
    """The paths in k8s.yaml's header commands (kubectl apply -f PATH) are printable, one line, and
    bash reads each back as the path: a person can paste them."""
    word = k8s.shell_word(text)
    assert word.isprintable()
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True)
    assert out.returncode == 0 and out.stdout == text.encode("utf-8"), (word, out.stderr)


def test_comment_is_one_yaml_line():
    for text in ("a\u2028b", "a\x85b", "a\u2029b", "a\nb", "a\rb", "\x01", "\ufeff"):
        line = k8s.comment(text)
        assert line.isprintable() and list(yaml.safe_load_all(line + "\nkey: 1\n")) == [{"key": 1}]


# --------------------------------------------------------------------------- refused, with a fix

@pytest.mark.parametrize("key, value, launcher, words", [
    ("run.dir", "/runs/a\0b", "sbatch", "holds a NUL character"),
    ("run.name", "a\0b", "sbatch", "holds a NUL character"),
    ("cluster.env.FOO", "a\0b", "sbatch", "holds a NUL character"),
    ("cluster.env.RANDOM", "BASH_VERSINFO[$(id)]", "sbatch", "a variable bash gives a meaning of its own"),
    ("cluster.env._", "x", "slurm", "a variable bash gives a meaning of its own"),
    ("cluster.env.run_dirs", "x", "sbatch", "which the batch script uses itself"),
    ("cluster.setup", ["ok", "a\0b"], "sbatch", "cluster.setup[1]="),
    ("run.dir", "/runs/100%j", "slurm", "holds a %, which submitit passes to Slurm unescaped"),
    ("run.dir", "/runs/a\\b", "slurm", "holds a backslash"),
    ("cluster.container_image", "nvcr.io/a\0b", "sbatch", "whitespace or a NUL character"),
])
def test_refused_on_the_login_node_with_the_key_and_a_fix(key, value, launcher, words):
    """What no serializer can carry is refused by the config check (python -m hpctrain's), naming the
    key and the fix."""
    from helpers import set_key

    cfg = config(launcher)
    set_key(cfg, key, value)
    found = [p for p in problems(cfg) if words in p]
    assert len(found) == 1, problems(cfg)
    name = key.rpartition(".")[2] if key.startswith("cluster.env.") else None
    assert found[0].startswith(key if name is None or "NUL" in words else "cluster.env has the key")
    if name is not None and "NUL" not in words:
        assert repr(name) in found[0]
    assert "Fix:" in found[0]


@pytest.mark.parametrize("key, value", [
    ("run.dir", "/mnt/runs/a\0b"), ("cluster.env.FOO", "a\0b"), ("cluster.container_python", "py\0"),
    ("launcher.k8s.node_selector.pool", "a\0b")])
def test_k8s_refuses_nul(key, value):
    from helpers import set_key

    cfg = config("k8s")
    set_key(cfg, key, value)
    found = [p for p in problems(cfg) if "NUL" in p]
    assert len(found) == 1 and found[0].startswith(f"{key}=") and f"Fix: remove it from {key}" in found[0], found
