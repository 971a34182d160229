"""A checkpoint is checked whole before any byte of it is used (issue 43): its metadata within bounds a
tiny hostile file cannot exceed, its chunks tiling every tensor exactly, its state entries of the kinds
and ranges the live objects hold, its tensors finite; a checkpoint that fails is refused naming the
fault, and resume falls back to an older one. Most tests work on small files in this process; the
resume tests share one tiny run on a world of one rank (as test_checkpoint_damage.py does)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from hpctrain.checkpoint import directories as store
from hpctrain.checkpoint import raw
from hpctrain.checkpoint.__main__ import export
from hpctrain.checkpoint.safe import (MAX_CHUNKS, MAX_CHUNKS_PER_TENSOR, MAX_METADATA_BYTES, DamagedCheckpoint,
                                      SafeReader, TensorOnlyLoadPlanner, check_shapes, read_metadata)

from helpers import REPO, run_main

# ----------------------------------------------------------------- (a) chunk layouts, against a grid

SHAPE = (6, 5)
TENSOR = torch.arange(1.0, 1.0 + math.prod(SHAPE)).reshape(SHAPE)  # no element is 0 or repeats


def write_layout(step_dir: Path, chunks: list[tuple[tuple, tuple]]) -> None:
    """A checkpoint of TENSOR as `model.w` stored as these (offsets, sizes) chunks, each chunk's bytes in
    one `.raw` file, as hpctrain's writer lays them out."""
    step_dir.mkdir(parents=True)
    records, blob = {}, bytearray()
    for i, (o, s) in enumerate(chunks):
        piece = TENSOR[o[0]:o[0] + s[0], o[1]:o[1] + s[1]].contiguous().numpy().tobytes()
        records[MetadataIndex("model.w", o, i)] = _StorageInfo("__0_0.raw", len(blob), len(piece))
        blob += piece
    (step_dir / "__0_0.raw").write_bytes(bytes(blob))
    item = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(SHAPE),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    md = Metadata({"model.w": item}, planner_data={"model.w": ("model", "w")}, storage_data=records)
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))


def tiles_exactly(chunks) -> bool:
    """The reference: paint a grid, every element covered once."""
    grid = np.zeros(SHAPE, dtype=int)
    for o, s in chunks:
        grid[o[0]:o[0] + s[0], o[1]:o[1] + s[1]] += 1
    return bool((grid == 1).all())


@st.composite
def layouts(draw) -> list:
    """Random guillotine tilings of SHAPE, then perhaps one fault: a chunk dropped (a gap), grown (an
    overlap), or shifted by one (an overlap and a gap of the same size: the element count still adds
    up), or an empty chunk added (as FSDP stores a shard of no rows: not a fault)."""
    boxes = [((0, 0), SHAPE)]
    for _ in range(draw(st.integers(0, 7))):
        i = draw(st.integers(0, len(boxes) - 1))
        o, s = boxes[i]
        dims = [d for d in range(2) if s[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, s[d] - 1))
        first = (o, tuple(cut if k == d else n for k, n in enumerate(s)))
        second = (tuple(v + cut if k == d else v for k, v in enumerate(o)), tuple(n - cut if k == d else n for k, n in enumerate(s)))
        boxes[i:i + 1] = [first, second]
    fault = draw(st.sampled_from(["none", "drop", "grow", "shift", "empty"]))
    i, d = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, 1))
    o, s = boxes[i]
    if fault == "drop" and len(boxes) > 1:
        del boxes[i]
    elif fault == "grow" and o[d] + s[d] < SHAPE[d]:
        boxes[i] = (o, tuple(n + 1 if k == d else n for k, n in enumerate(s)))
    elif fault == "shift":
        step = draw(st.sampled_from([-1, 1]))
        moved = tuple(v + step if k == d else v for k, v in enumerate(o))
        if 0 <= moved[d] and moved[d] + s[d] <= SHAPE[d]:
            boxes[i] = (moved, s)
    elif fault == "empty":
        boxes.append(((SHAPE[0], 0), (0, SHAPE[1])))
    return boxes


@settings(max_examples=80, deadline=None)
@given(layouts())
@example([((0, 0), (3, 5)), ((3, 0), (3, 5))])  # two FSDP shards
@example([((0, 0), (6, 2)), ((0, 2), (6, 3))])  # two TP shards
@example([((0, 0), (3, 5))])  # rows 3-5 in no chunk: the export wrote uninitialised memory
@example([((0, 0), (4, 5)), ((3, 0), (3, 5))])  # row 3 twice
@example([((0, 0), (3, 2)), ((0, 2), (3, 3)), ((3, 1), (3, 2)), ((3, 2), (3, 3))])  # shifted: the count adds up
def test_a_random_chunk_layout_loads_exactly_or_is_refused(chunks):
    """Refused exactly when the grid says the chunks do not tile the tensor; otherwise both the export
    and a load into a tensor that already holds other values give the tensor back exactly, and a refused
    export writes no file. Mutants: the element-count check dropped (a dropped chunk exports whatever
    torch.empty held); the overlap sweep dropped (the shifted layouts load, one row written twice and one
    kept from before)."""
    with tempfile.TemporaryDirectory() as tmp:
        step_dir, out = Path(tmp) / "step-00000001", Path(tmp) / "out.safetensors"
        write_layout(step_dir, chunks)
        exact = tiles_exactly(chunks)
        try:
            flat = export(step_dir, out)
        except DamagedCheckpoint as e:
            assert not exact, f"an exact tiling was refused: {e}"
            assert "model.w" in str(e) and not out.exists()
            return
        assert exact, f"{chunks} do not tile {SHAPE}, yet the export wrote {flat['w']}"
        assert torch.equal(flat["w"], TENSOR)
        target = {"model": {"w": torch.full(SHAPE, -7.0)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(target, storage_reader=SafeReader(str(step_dir)), planner=TensorOnlyLoadPlanner(), no_dist=True)
        assert torch.equal(target["model"]["w"], TENSOR)


def _shorter(md, index, info):
    md.storage_data[index] = dataclasses.replace(info, length=info.length - 4)


def _distcp_shorter(md, index, info):
    md.storage_data[index] = dataclasses.replace(info, relative_path="__0_0.distcp", length=info.length - 4)


def _unrecorded(md, index, info):
    del md.storage_data[index]


def _stray(md, index, info):
    md.storage_data[MetadataIndex("model.w", (3, 0))] = info


@pytest.mark.parametrize("edit, words", [
    (_shorter, r"the storage of model.w at offsets \[0, 0\] is 116 bytes in __0_0.raw; its chunk holds 120"),
    (_distcp_shorter, r"the storage of model.w at offsets \[0, 0\] is 116 bytes in __0_0.distcp; its chunk holds 120"),
    (_unrecorded, r"the chunk of model.w at offsets \[0, 0\] has no storage record"),
    (_stray, r"2 tensor storage records for 1 chunks: two chunks share their offsets, or a record belongs to no chunk"),
])
def test_each_chunk_has_one_storage_record_of_its_length(tmp_path, edit, words):
    """A `.raw` item shorter than its chunk was read as far as the metadata said, then failed deep in a
    DCP worker; a `.distcp` item (torch.save's zip) may be longer than its bytes, not shorter. Mutants: no
    length check (the refusal comes from raw._pread inside DCP, not from read_metadata); no record
    lookup (a KeyError in DCP's planner); no count of matched records."""
    write_layout(tmp_path / "a", [((0, 0), SHAPE)])
    md = pickle.loads((tmp_path / "a" / ".metadata").read_bytes())
    (index, info), = md.storage_data.items()
    edit(md, index, info)
    (tmp_path / "a" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(DamagedCheckpoint, match=words):
        read_metadata(tmp_path / "a")


def test_a_checkpoint_holding_a_model_tensor_this_model_lacks_is_refused(tmp_path):
    """check_shapes checked only that the model's tensors were there: a checkpoint with more (another
    model's layers, a LoRA run's adapters) loaded and dropped the rest silently. Optimizer keys are not
    held to it. Mutant: the `exact` prefixes ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"a": torch.ones(2), "layers.9.lora_A": torch.ones(2)}, "optim": {"x": torch.ones(1)}},
                 storage_writer=raw.RawWriter(str(tmp_path)), no_dist=True)
    md = read_metadata(tmp_path)
    check_shapes(md, {"model.a": (2,), "model.layers.9.lora_A": (2,)}, exact=("model.",))
    with pytest.raises(DamagedCheckpoint, match=r"different model: model.layers.9.lora_A is in the checkpoint "
                                                r"but not in this model$"):
        check_shapes(md, {"model.a": (2,)}, exact=("model.",))


# ---------------------------------------------- (b) hostile metadata, in a process capped at 3 GiB

def _global(module: str, name: str) -> bytes:
    enc = lambda s: b"\x8c" + bytes([len(s.encode())]) + s.encode()  # noqa: E731  SHORT_BINUNICODE
    return enc(module) + enc(name) + b"\x93"


def _real(edit) -> bytes:
    """The pickled metadata of a small real checkpoint (one tensor, model.w), edited."""
    with tempfile.TemporaryDirectory() as tmp:
        write_layout(Path(tmp) / "s", [((0, 0), SHAPE)])
        md = pickle.loads((Path(tmp) / "s" / ".metadata").read_bytes())
    edit(md)
    return pickle.dumps(md)


def _chunks(md, chunks: list) -> None:
    md.state_dict_metadata["model.w"].chunks = chunks


def _many_tensors(md) -> None:
    """200 tensors sharing one list of 50,000 chunks: 10 M chunks from a 100 KB list."""
    shared = md.state_dict_metadata["model.w"].chunks * 50_000
    for i in range(200):
        md.state_dict_metadata[f"model.t{i}"] = dataclasses.replace(md.state_dict_metadata["model.w"], chunks=shared)


MILLION = b"](" + b"K\x01" * 1_000_000 + b"e"  # a list of a million ints (2 MB)
HOSTILE = {
    # the review's 44 bytes: 5 GB and 141 s before the refusal
    "size-of-bytes": (lambda: b"\x80\x04" + _global("torch", "Size") + _global("builtins", "bytes") + b"J\x00\xa3\xe1\x11\x85R\x85R.",
                      "refusing builtins.bytes(300000000): it takes at most one bytes or bytearray or list or tuple"),
    # bytes.__new__(bytes, 3 * 10**8) by NEWOBJ: an admitted callable is no class
    "newobj-bytes": (lambda: b"\x80\x04" + _global("builtins", "bytes") + b"J\x00\xa3\xe1\x11\x85\x81.",
                     "NEWOBJ class argument"),  # "isn't a type object" / "must be a type, not function"
    # MetadataIndex's __init__ copies its offset into a torch.Size: called 2,000 times on a million ints,
    # each result kept
    "call-a-record": (lambda: b"\x80\x04]" + MILLION + b"\x940" + (_global("torch.distributed.checkpoint.metadata", "MetadataIndex")
                                                             + b"\x8c\x01w" + b"h\x00\x86Ra") * 2000 + b".",
                      "refusing to call torch.distributed.checkpoint.metadata.MetadataIndex('w', a list of 1,000,000 items)"),
    # list() of one list of a million, 2,000 times, each copy kept: 16 GB from a 2 MB file
    "copy-a-list": (lambda: b"\x80\x04]" + MILLION + b"\x940" + (_global("builtins", "list") + b"h\x00\x85Ra") * 2000 + b".",
                    "asks its calls for more elements than the file has bytes"),
    # str() of a list of 1,000 references to a 100 KB string: 100 MB of text per call
    "spell-a-list": (lambda: b"\x80\x04" + _global("builtins", "str") + b"X" + (100_000).to_bytes(4, "little") + b"a" * 100_000
                     + b"\x940]" + b"(" + b"h\x00" * 1000 + b"e\x85R.",
                     "refusing builtins.str(a list of 1,000 items): it takes at most one int or float or bool or str"),
    "a-long-shape": (lambda: b"\x80\x04" + _global("torch", "Size") + b"](" + b"J\xff\xff\xff\x7f" * 40 + b"e\x85R.",
                     "refusing torch.Size(a list of 40 items): a shape is one list of at most 32"),
    "a-huge-tensor": (lambda: _real(lambda md: setattr(md.state_dict_metadata["model.w"], "size", torch.Size([1 << 40, 128]))),
                      "model.w has shape [1099511627776, 128]: more than 1,099,511,627,776 elements"),
    "many-chunks": (lambda: _real(lambda md: _chunks(md, md.state_dict_metadata["model.w"].chunks * 1_000_000)),
                    f"model.w has 1,000,000 chunks, more than the {MAX_CHUNKS_PER_TENSOR:,} a tensor may have"),
    "many-chunks-in-all": (lambda: _real(_many_tensors), f"its tensors have more than {MAX_CHUNKS:,} chunks in all"),
    "a-list-index-in-planner-data": (lambda: _real(lambda md: md.planner_data.update({"model.w": ("model", 10**10)})),
                                     "planner_data of 'model.w' is ('model', 10000000000): a tuple of at most 16 names"),
    "planner-data-for-no-tensor": (lambda: _real(lambda md: md.planner_data.update({f"k{i}": ("k",) for i in range(100_000)})),
                                   "its planner_data has 100,001 entries for 1 tensors"),
}


def test_hostile_metadata_is_refused_within_bounded_memory(tmp_path):
    """Each file is read in one process whose address space is capped at 3 GiB (importing torch takes
    ~1.5), and refused with its message; the old reader ran out of memory or time on every one but
    the last. Mutants: each bound in turn (the bytes() check, the record stand-ins, the call budget,
    str()'s scalars, the Size check, the per-tensor and total chunk counts, the planner checks, the file
    size cap) makes its case run out of memory, hang or pass."""
    for name, (make, _) in HOSTILE.items():  # made here, not when the suite is collected
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(make())
    (tmp_path / "huge-file").mkdir()
    with open(tmp_path / "huge-file" / ".metadata", "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used
    script = textwrap.dedent("""
        import json, sys
        from hpctrain.checkpoint.safe import DamagedCheckpoint, read_metadata
        out = {}
        for d in sys.argv[1:]:
            try:
                read_metadata(d)
                out[d] = "read"
            except DamagedCheckpoint as e:
                out[d] = str(e)
        print(json.dumps(out))
    """)
    cap = 3 << 30
    dirs = [str(tmp_path / n) for n in [*HOSTILE, "huge-file"]]
    proc = subprocess.run([sys.executable, "-c", script, *dirs], cwd=REPO, capture_output=True, text=True,
                          timeout=600, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    want = {**{n: w for n, (_, w) in HOSTILE.items()},
            "huge-file": f"is {MAX_METADATA_BYTES + 1:,} bytes, more than checkpoint metadata can be ({MAX_METADATA_BYTES:,}"}
    for name, words in want.items():
        msg = got[str(tmp_path / name)]
        assert words in msg and str(tmp_path / name / ".metadata") in msg, (name, msg)


# ------------------------------------------------- (c, d) resume: damaged state, non-finite tensors

BASE = ("+experiment=tiny", "launcher.nproc=1", "train.global_batch=4", "train.micro_batch=2",
        "data.seq_len=16", "optim.warmup_steps=1")


def _trainer(run_dir: Path, *overrides: str):
    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer.of(compose([*BASE, f"run.dir={run_dir}", *overrides]), str(run_dir), torch.device("cpu"))


@pytest.fixture(scope="module")
def trained(world_of_one, tmp_path_factory):
    """(a run with complete checkpoints at steps 2 and 4, a trainer whose objects resume from copies)."""
    run = tmp_path_factory.mktemp("whole") / "run"
    _trainer(run, "train.steps=4", "checkpoint.every=2").fit()
    return run, _trainer(tmp_path_factory.mktemp("whole") / "live", "train.steps=6", "checkpoint.every=2")


def _copy(trained, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    return run


def _resume(trained, run: Path) -> tuple[int, list[str]]:
    from hpctrain.checkpoint.manager import CheckpointManager

    t = trained[1]
    warned: list[str] = []
    step = CheckpointManager(run, t.cfg.checkpoint, t.ckpt.objects, total_steps=6).resume(warned.append)
    return step, warned


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _write_nan(step_dir: Path, fqn: str) -> None:
    md = read_metadata(step_dir)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    with open(step_dir / info.relative_path, "r+b") as f:
        f.seek(info.offset + 4)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())


INFO4 = Path("checkpoints") / "step-00000004" / "hpctrain.json"
RNG4 = Path("checkpoints") / "step-00000004" / "rng" / "rank-00000.json"
DAMAGE = {
    # hpctrain.json's entries: used as they were (a negative data position, a position in the schedule
    # that is text) or a crash on every restart with no fallback
    "scheduler-negative-position": (INFO4, lambda d: d["scheduler"].update(last_epoch=-3),
                                    "hpctrain.json's scheduler.last_epoch is -3: it must be finite, at least 0"),
    "scheduler-position-as-text": (INFO4, lambda d: d["scheduler"].update(last_epoch="4"),
                                   "hpctrain.json's scheduler.last_epoch is \"4\", not a whole number"),
    # Mutant: Schedule.state_problem removed (the run would restart its warmup from the live position).
    "scheduler-no-position": (INFO4, lambda d: d["scheduler"].pop("last_epoch"),
                              "hpctrain.json's scheduler: holds no 'last_epoch' (the position in the schedule)"),
    "negative-data-position": (INFO4, lambda d: d["data"].update(position=-8),
                               "hpctrain.json's data.position is -8: it must be finite, at least 0"),
    "tokens-as-text": (INFO4, lambda d: d["progress"].update(tokens_seen="many"),
                       "hpctrain.json's progress.tokens_seen is \"many\", not a whole number"),
    "world-size-as-text": (INFO4, lambda d: d.update(world_size="1"), "hpctrain.json says world_size '1'"),
    # the per-rank RNG file: a crash in torch.set_rng_state, numpy or random on every restart
    "rng-torch-short": (RNG4, lambda d: d.update(torch_cpu="AAAA"), "torch_cpu holds 3 bytes, the generator's state is 5056"),
    "rng-numpy-keys": (RNG4, lambda d: d["numpy"].__setitem__(1, [1, 2, 3]), "numpy is not a MT19937 state"),
    "rng-python-missing": (RNG4, lambda d: d.pop("python"), "rank-00000.json: holds no 'python'"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_state_entry_falls_back_to_the_older_checkpoint(trained, tmp_path, case):
    """The newest checkpoint's entry is damaged: resume names the file, the entry and the fault, and
    loads step 2. Mutants: state_problem accepting any value of a key (the kinds), any number (the
    range), extra keys; no trial load of the plain states (the missing key crashes); rng.state_problem
    always None (torch/numpy/random raise on every restart)."""
    run = _copy(trained, tmp_path)
    file, edit, words = DAMAGE[case]
    _edit_json(run / file, edit)
    step, warned = _resume(trained, run)
    assert step == 2, warned
    assert any(str(run / file.parent) in w and words in w and "trying an older one" in w for w in warned), warned


def test_a_schedulers_other_keys_are_ignored_never_loaded(trained, tmp_path):
    """Of torch's LambdaLR state only the position is loaded: the keys another torch version writes
    (`verbose`), saved base rates and a dict in lr_lambdas (which LambdaLR.load_state_dict would merge into
    the lambda's __dict__) are ignored, and the learning rate is this run's at that position. Mutants: the
    whole saved dict loaded (lr 5.0 * factor); unknown keys refused (step 2 resumed)."""
    sched = trained[1].ckpt.objects["scheduler"]
    step, warned = _resume(trained, _copy(trained, tmp_path / "plain"))
    lrs = [g["lr"] for g in sched.optimizer.param_groups]
    run = _copy(trained, tmp_path / "edited")
    _edit_json(run / INFO4, lambda d: d["scheduler"].update(
        verbose=False, base_lrs=[5.0, 5.0], _last_lr=[9.0, 9.0], lr_lambdas=[{"__code__": 1}, None]))
    assert _resume(trained, run) == (step, warned) == (4, [])
    assert [g["lr"] for g in sched.optimizer.param_groups] == lrs
    assert all("__code__" not in getattr(f, "__dict__", {}) for f in sched.scheduler.lr_lambdas)


def test_an_undamaged_run_resumes_from_the_newest_with_its_state(trained, tmp_path):
    """The checks refuse nothing real: the newest checkpoint loads, its data position and step with it."""
    run = _copy(trained, tmp_path)
    step, warned = _resume(trained, run)
    assert (step, warned) == (4, [])
    assert trained[1].sampler.position == 16 and trained[1].progress.step == 4


@pytest.mark.parametrize("fqn", ["model.norm.weight", "optim.output.weight.exp_avg_sq"])
def test_a_checkpoint_with_a_nan_is_refused_naming_the_tensor(trained, tmp_path, fqn):
    """A NaN written into one float of the newest checkpoint: resumed silently before (and trained on).
    Mutant: no finite check after the load (step 4 is resumed)."""
    run = _copy(trained, tmp_path)
    _write_nan(run / "checkpoints" / "step-00000004", fqn)
    step, warned = _resume(trained, run)
    assert step == 2, warned
    assert any(f"step-00000004 is unusable: {fqn} holds a non-finite value (NaN or infinity) on rank 0" in w
               for w in warned), warned


def test_a_state_with_a_nan_is_not_saved(trained, tmp_path, caplog):
    """A save of a state holding a NaN is skipped, logged with the tensor and the step, and the run goes
    on; the next finite save commits with `finite: true` in hpctrain.json. Mutants: no check before the
    save (step 5 is committed); the verdict ignored (same)."""
    from hpctrain.checkpoint.manager import CheckpointManager

    t = trained[1]
    run = tmp_path / "run"
    manager = CheckpointManager(run, t.cfg.checkpoint, t.ckpt.objects, total_steps=6)
    weight = t.parts[0].norm.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[3] = float("inf")
    try:
        with caplog.at_level(logging.WARNING, logger="hpctrain"):
            manager.save(5)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert store.list_complete(run / "checkpoints") == []
    assert any("checkpoint of step 5 not saved: model.norm.weight holds a non-finite value (NaN or infinity) "
               "on rank 0; there is no earlier checkpoint" in r.getMessage() for r in caplog.records), caplog.text
    manager.save(6)
    manager.close()
    assert json.loads((run / "checkpoints" / "step-00000006" / "hpctrain.json").read_text())["finite"] is True


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path):
    """Checkpoints written without the finite check (an older hpctrain: no `finite` in hpctrain.json)
    never push out the newest one known finite. Mutant: doom without newest_finite (step 1 is deleted,
    leaving only checkpoints that may hold NaNs)."""
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        d = root / store.step_name(step)
        d.mkdir(parents=True)
        (d / store.DCP_METADATA).write_bytes(b"")
        (d / store.INFO).write_text(json.dumps({"world_size": 1, **({"finite": True} if step <= 2 else {})}))
    store.purge(store.doom(root, keep=2))
    assert [s for s, _ in store.list_complete(root)] == [2, 4, 5]


# ------------------------------------------------------------ (e) the command line on malformed files

def _complete(root: Path, step: int, info: str | None) -> Path:
    d = root / "checkpoints" / store.step_name(step)
    d.mkdir(parents=True)
    (d / store.DCP_METADATA).write_bytes(b"")
    if info is not None:
        (d / store.INFO).write_text(info)
    return d


@pytest.mark.parametrize("info, words", [
    ("{not json", "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2"),
    ("[1, 2]", "holds a JSON array, not an object"),
    ('{"world_size": "many", "time": 0}', "says world_size 'many': not a positive whole number"),
    (None, "is 16,777,217 bytes, more than such a file can be (16,777,216)"),  # sparse, past the cap
])
def test_checkpoint_list_names_a_malformed_hpctrain_json_in_one_line(tmp_path, info, words):
    """The good checkpoints are listed, the bad one gets one line on stderr, exit 2. Mutant: the old
    listing (a JSONDecodeError, AttributeError or TypeError traceback)."""
    good = _complete(tmp_path, 2, json.dumps({"world_size": 2, "time": 0, "progress": {"tokens_seen": 1024}}))
    bad = _complete(tmp_path, 4, info)
    if info is None:
        with open(bad / store.INFO, "wb") as f:
            f.truncate((16 << 20) + 1)
    r = run_main("hpctrain.checkpoint", "list", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    rows = r.stdout.splitlines()[1:]
    assert len(rows) == 1 and rows[0].endswith(f"{2:>5}  {'1,024':>14}  {good}"), r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad / store.INFO} ") and words in lines[0], r.stderr


def test_export_names_malformed_files_in_one_line(tmp_path):
    """`export` of a checkpoint whose hpctrain.json or metadata is malformed: one line, exit 2. Mutants: the
    old hf export (a JSONDecodeError traceback); no tiling check (a file of uninitialised rows written)."""
    step_dir = tmp_path / "run" / "checkpoints" / "step-00000001"
    write_layout(step_dir, [((0, 0), (3, 5))])
    (step_dir / store.INFO).write_text("{not json")
    hf = run_main("hpctrain.checkpoint", "export", str(step_dir), str(tmp_path / "hf"), "--format", "hf")
    single = run_main("hpctrain.checkpoint", "export", str(step_dir), str(tmp_path / "w.safetensors"))
    for r, words in ((hf, "hpctrain.json is not valid JSON"), (single, "the chunks of model.w hold 15 elements, the tensor 30")):
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and words in r.stderr, r.stderr
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "hf").exists()
