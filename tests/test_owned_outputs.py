"""Tools never destroy files they did not write (hpctrain.core.outdir): prepare, the Hugging Face export
and the report each refuse a directory holding a user's files, replace their own earlier output whole
(nothing stale stays), and leave it byte for byte when a run fails part way. Prepare refuses an output
inside its corpus and names the file and line of JSON nested too deep to parse."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import pytest

from hpctrain.core import outdir
from hpctrain.core.outdir import MARKER, OutputDirError
from hpctrain.data import prepare as prep
from hpctrain.data.documents import CorpusError
from hpctrain.data.prepare import prepare

FIX = "Fix: choose a new or empty directory"


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file of `d` (flat, as the tools write) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def siblings(d: Path) -> list[str]:
    """Build or swap directories a run left beside `d`."""
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


@pytest.fixture
def corpus(tmp_path) -> Path:
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 20)
    (src / "b.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(12)))
    return src


def word_tokenizer(d: Path) -> Path:
    """A tiny Hugging Face tokenizer.json (word level), made in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "alpha", "beta", "gamma", "document"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


# --- prepare ------------------------------------------------------------------------------------

def test_prepare_refuses_a_directory_with_the_users_files(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mine = {"train-set.bin": b"my training set", "val-results.bin.bak": b"my results",
            "tokenizer.json": b"{}", "meta.json": b'{"mine": 1}'}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    with pytest.raises(OutputDirError) as e:
        prepare(corpus, out, val_fraction=0)
    assert str(e.value).startswith(f"{out} holds files hpctrain.data.prepare did not write (meta.json, tokenizer.json, "
                                   f"train-set.bin, val-results.bin.bak)")
    assert FIX in str(e.value)
    assert snapshot(out) == mine and not siblings(out)


def test_prepare_again_replaces_its_own_output_and_nothing_stale_stays(corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare(corpus, out, word_tokenizer(tmp_path / "tok"), val_fraction=0.3, shard_bytes=16)
    assert len(first["splits"]["train"]["shards"]) > 2 and "val" in first["splits"]
    assert (out / "tokenizer.json").is_file()
    second = prepare(corpus, out, val_fraction=0)  # bytes: no tokenizer, no validation, one shard
    assert sorted(os.listdir(out)) == [MARKER, "meta.json", "train-00000.bin"]
    assert json.loads((out / "meta.json").read_text()) == second
    assert json.loads((out / MARKER).read_text()) == {"tool": "hpctrain.data.prepare",
                                                       "files": ["meta.json", "train-00000.bin"]}
    assert not siblings(out)


def test_prepare_reads_the_tokenizer_of_its_own_earlier_output(corpus, tmp_path):
    out = tmp_path / "out"
    prepare(corpus, out, word_tokenizer(tmp_path / "tok"), val_fraction=0)
    meta = prepare(corpus, out, out / "tokenizer.json", val_fraction=0)  # was SameFileError, after deleting meta.json
    assert meta["tokenizer"]["kind"] == "hf" and (out / "tokenizer.json").read_bytes() == \
        (tmp_path / "tok" / "tokenizer.json").read_bytes()


def test_a_prepare_that_fails_part_way_leaves_the_earlier_output_whole(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare(corpus, out, val_fraction=0, shard_bytes=64)
    before = snapshot(out)
    (corpus / "c.txt").write_text("more text " * 50)  # a different output, its shards written before the failure

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prep, "_copy_tokenizer", full_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare(corpus, out, val_fraction=0, shard_bytes=64)
    assert snapshot(out) == before and not siblings(out)


@pytest.mark.parametrize("where", [".", "shards", "deeper/shards"])
def test_an_output_inside_the_corpus_is_refused(corpus, where):
    out = corpus / where
    with pytest.raises(OutputDirError, match=f"{out} is inside the corpus directory {corpus}: .* Fix: write the "
                                             f"shards outside {corpus}"):
        prepare(corpus, out, val_fraction=0)
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt", "b.jsonl"]


def test_an_output_inside_the_corpus_through_a_symlink_is_refused(corpus, tmp_path):
    (tmp_path / "link").symlink_to(corpus)
    with pytest.raises(OutputDirError, match="is inside the corpus directory"):
        prepare(tmp_path / "link", corpus / "shards", val_fraction=0)
    with pytest.raises(OutputDirError, match="is inside the corpus directory"):
        prepare(corpus, tmp_path / "link" / "shards", val_fraction=0)


def test_json_nested_too_deep_is_refused_with_the_file_and_line(tmp_path):
    src = tmp_path / "deep.jsonl"
    src.write_text('{"text": "fine"}\n\n{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(CorpusError, match=rf"^{src}:4 nests JSON deeper than Python's parser goes\. Fix: "):
        prepare(src, tmp_path / "out", val_fraction=0)
    assert not (tmp_path / "out").exists() and not siblings(tmp_path / "out")


def test_prepare_cli_says_what_is_wrong_without_a_traceback(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert prep.main([str(corpus), str(out), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} holds files hpctrain.data.prepare did not write (notes.txt)") and FIX in err
    assert (out / "notes.txt").read_text() == "mine"


# --- the output directory itself ------------------------------------------------------------------

def write_files(d: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (d / name).write_text(text)


def test_a_users_file_added_to_the_tools_own_output_survives(tmp_path):
    out = tmp_path / "out"
    with outdir.replacing(out, "tool") as d:
        write_files(d, {"a": "1"})
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match=r"holds files tool did not write \(notes.txt\)"):
        outdir.begin(out, "tool")
    assert snapshot(out)["notes.txt"] == b"mine" and (out / "a").read_text() == "1"


def test_another_tools_output_is_refused(tmp_path):
    out = tmp_path / "out"
    with outdir.replacing(out, "hpctrain.report") as d:
        write_files(d, {"report.html": "x"})
    with pytest.raises(OutputDirError, match=f"{out} is the output of hpctrain.report, not of hpctrain.data.prepare"):
        outdir.check(out, "hpctrain.data.prepare")


@pytest.mark.parametrize("marker", ["not json", '{"tool": "tool", "files": "a"}', "[" * 100_000 + "]" * 100_000],
                         ids=["not-json", "files-not-a-list", "nested-100000-deep"])
def test_a_damaged_marker_makes_the_directory_foreign(tmp_path, marker):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("1")
    (out / MARKER).write_text(marker)
    with pytest.raises(OutputDirError, match=r"did not write \(\.hpctrain-output\.json, a\)"):
        outdir.check(out, "tool")


def test_a_file_put_into_the_output_while_it_is_built_survives(tmp_path):
    out = tmp_path / "out"
    with outdir.replacing(out, "tool") as d:
        write_files(d, {"a": "old"})
    with pytest.raises(OutputDirError, match=r"did not write \(late.txt\).*The new output is complete in "):
        with outdir.replacing(out, "tool") as d:
            write_files(d, {"a": "new"})
            (out / "late.txt").write_text("mine")
    assert snapshot(out) == {MARKER: snapshot(out)[MARKER], "a": b"old", "late.txt": b"mine"}
    [kept] = siblings(out)  # the finished new output, for the user to move
    assert (out.parent / kept / "a").read_text() == "new"


def test_a_failed_swap_puts_the_earlier_output_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with outdir.replacing(out, "tool") as d:
        write_files(d, {"a": "old"})
    before = snapshot(out)
    rename = os.rename

    def refuse_new(src, dst):
        if ".partial-" in str(src):
            raise OSError(16, "Device or resource busy")
        rename(src, dst)

    monkeypatch.setattr(outdir.os, "rename", refuse_new)
    with pytest.raises(OutputDirError, match=f"could not put the new output in place of {out} "):
        with outdir.replacing(out, "tool") as d:
            write_files(d, {"a": "new"})
    assert snapshot(out) == before and not siblings(out)


def test_a_symlinked_output_stays_a_symlink(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    for text in ("1", "2"):
        with outdir.replacing(link, "tool") as d:
            write_files(d, {"a": text})
    assert link.is_symlink() and (real / "a").read_text() == "2" and not siblings(real)


def test_an_empty_directory_keeps_its_permissions(tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    out.chmod(0o750)
    with outdir.replacing(out, "tool") as d:
        write_files(d, {"a": "1"})
    assert (out.stat().st_mode & 0o777) == 0o750


def test_a_file_its_parent_or_the_current_directory_is_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(OutputDirError, match="f is a file, not a directory"):
        outdir.begin(tmp_path / "f", "tool")
    with pytest.raises(OutputDirError, match=rf"cannot create \.sub\.partial-\S+ beside {tmp_path / 'f' / 'sub'}, .*"
                                             rf"\(File exists: {tmp_path / 'f'}\)\. Fix: "):
        outdir.begin(tmp_path / "f" / "sub", "tool")  # a file where its parent directory should be
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(OutputDirError, match=r"^\. is the current directory"):
        outdir.begin(".", "tool")
    assert (tmp_path / "f").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["f", "here"]


# --- the Hugging Face export ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    """The smallest checkpoint export reads: a 1-layer Llama's weights saved by DCP, and hpctrain.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint.raw import RawWriter
    from hpctrain.core.rundir import INFO
    from hpctrain.core.schema import ModelConfig
    from hpctrain.models.llama import Llama

    m = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=64)
    torch.manual_seed(0)
    weights = {n: p.detach() for n, p in Llama(m, 16).named_parameters()}
    step = tmp_path_factory.mktemp("run") / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": weights}, storage_writer=RawWriter(str(step), thread_count=1), no_dist=True)
    (step / INFO).write_text(json.dumps({"step": 1, "world_size": 1,
                                         "config": {"model": dataclasses.asdict(m), "data": {"seq_len": 16}}}))
    return step


EXPORT = "hpctrain.checkpoint export --format hf"
# The checkpoint costs torch, DCP and the model (seconds, once per module): the export tests are slow.


@pytest.mark.slow
def test_export_refuses_a_directory_with_the_users_files(step_dir, tmp_path):
    from hpctrain.checkpoint.hf_weights import export_hf

    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("my model card")
    (out / "config.json").write_text("{}")
    with pytest.raises(OutputDirError) as e:
        export_hf(step_dir, out)
    assert str(e.value).startswith(f"{out} holds files {EXPORT} did not write (README.md, config.json)")
    assert FIX in str(e.value)
    assert snapshot(out) == {"README.md": b"my model card", "config.json": b"{}"} and not siblings(out)


@pytest.mark.slow
def test_a_sharded_export_over_a_single_file_export_leaves_no_old_weights(step_dir, tmp_path):
    from hpctrain.checkpoint.hf_weights import export_hf
    from hpctrain.core import hf_format as hf

    out = tmp_path / "hf"
    export_hf(step_dir, out)
    assert (out / "model.safetensors").is_file()
    index = export_hf(step_dir, out, shard_bytes=3000)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    # transformers loads model.safetensors before an index: it must be gone.
    assert sorted(os.listdir(out)) == sorted([MARKER, hf.CONFIG, "generation_config.json", hf.INDEX, *shards])
    assert not siblings(out)


@pytest.mark.slow
def test_an_export_that_fails_part_way_leaves_the_earlier_export_whole(step_dir, tmp_path, monkeypatch):
    from hpctrain.checkpoint import hf_weights

    out = tmp_path / "hf"
    hf_weights.export_hf(step_dir, out)
    before = snapshot(out)

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_weights, "_copy_tokenizer", full_disk)  # after every weights file is written
    with pytest.raises(OSError, match="No space left"):
        hf_weights.export_hf(step_dir, out, dtype="bf16", shard_bytes=3000)
    assert snapshot(out) == before and not siblings(out)


@pytest.mark.slow
def test_export_cli_says_what_is_wrong_without_a_traceback(step_dir, tmp_path, capsys):
    from hpctrain.checkpoint.__main__ import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    assert main(["export", str(step_dir), str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'hf'} holds files {EXPORT} did not write (notes.txt)")
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"


# --- the report ---------------------------------------------------------------------------------

@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({"model": "tiny"}))  # no metrics: nothing to draw
    return d


def test_report_refuses_a_directory_with_the_users_files(run_dir, tmp_path):
    from hpctrain.report import run_report

    out = tmp_path / "mine"
    out.mkdir()
    (out / "loss.png").write_bytes(b"my photo")
    (out / "report.html").write_text("my notes")
    with pytest.raises(OutputDirError) as e:
        run_report.write(run_dir, out)
    assert str(e.value).startswith(f"{out} holds files hpctrain.report did not write (loss.png, report.html)")
    assert FIX in str(e.value)
    assert snapshot(out) == {"loss.png": b"my photo", "report.html": b"my notes"} and not siblings(out)


def fake_plot(run, out):
    """A loss plot while the run has metrics (matplotlib takes seconds; the directory is what is tested)."""
    if not run.metrics:
        return None
    (out / "loss.png").write_bytes(b"png")
    return "loss.png"


def test_a_new_report_replaces_its_own_earlier_one(run_dir, monkeypatch):
    from hpctrain.report import run_report

    monkeypatch.setattr(run_report, "PLOTS", {"loss.png": ("Loss", fake_plot)})
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    page = run_report.write(run_dir)
    assert page == run_dir / "report" / "report.html" and (run_dir / "report" / "loss.png").is_file()
    (run_dir / "metrics.jsonl").unlink()
    run_report.write(run_dir)  # the default directory again: no loss to draw now
    assert sorted(os.listdir(run_dir / "report")) == [MARKER, "report.html"]
    assert 'src="loss.png"' not in page.read_text() and not siblings(run_dir / "report")


def test_a_report_that_fails_part_way_leaves_the_earlier_one_whole(run_dir, monkeypatch):
    from hpctrain.report import run_report

    run_report.write(run_dir)
    before = snapshot(run_dir / "report")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # a plot is drawn before the failure

    def broken(*_):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(run_report, "PLOTS", {"loss.png": ("Loss", fake_plot)})
    monkeypatch.setattr(run_report, "render", broken)
    with pytest.raises(RuntimeError, match="drawing failed"):
        run_report.write(run_dir)
    assert snapshot(run_dir / "report") == before and not siblings(run_dir / "report")


def test_the_sweep_report_refuses_a_directory_with_the_users_files(tmp_path, capsys):
    from hpctrain.report.__main__ import main

    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "sweep.tsv").write_text("my table")
    assert main([str(tmp_path / "sweep"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} holds files hpctrain.report did not write (sweep.tsv)") and FIX in err
    assert snapshot(out) == {"sweep.tsv": b"my table"}


def test_the_example_corpus_refuses_a_directory_with_the_users_files(tmp_path, capsys):
    """`python -m hpctrain.data.example OUT` wrote corpus.jsonl and tokenizer.json over whatever was in
    OUT (mutant: build() writing in place). Refused before any work, the user's file kept."""
    from hpctrain.data.example import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "corpus.jsonl").write_text('{"text": "mine"}\n')
    assert main([str(out), "--mb", "0.01"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "corpus.jsonl" in err and "Fix:" in err, err
    assert (out / "corpus.jsonl").read_text() == '{"text": "mine"}\n' and os.listdir(out) == ["corpus.jsonl"]


# ------------------------------------------------------------------------- the planner's single files

def test_the_planners_files_are_written_over_only_when_they_are_its_own(tmp_path, capsys):
    """`python -m hpctrain.plan ... --png/--json PATH` and `python benchmarks/calibration --png PATH`: a file the user has
    there (any PNG or JSON, or another file) is refused before any work and left byte for byte; the
    planner's own earlier plot or plan.json (they say so inside) is replaced. Mutants: no check (the
    user's picture overwritten); the mark not written or not read (the planner's own file refused)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import helpers  # noqa: F401  (the calibration, beside the package)
    from calibration import published_moe, published_plot
    from calibration.__main__ import main as calibration_main
    from hpctrain.plan.__main__ import main
    from hpctrain.plan.verdict import TOOL

    theirs = tmp_path / "holiday.png"
    fig = plt.figure()
    fig.savefig(theirs)  # a real PNG, written by matplotlib for someone else
    plt.close(fig)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    before = theirs.read_bytes(), notes.read_bytes()
    assert calibration_main(["--png", str(theirs)]) == 2
    assert "holiday.png exists and was not written by hpctrain.plan" in capsys.readouterr().err
    assert main(["+experiment=tiny", "--json", str(notes)]) == 2
    assert "notes.json exists and was not written by hpctrain.plan" in capsys.readouterr().err
    assert (theirs.read_bytes(), notes.read_bytes()) == before
    assert "is a directory" in outdir.file_problem(tmp_path, TOOL)

    ours = tmp_path / "published.png"
    published_plot.save_published_png([], published_moe.load(), str(ours))
    assert outdir.written_by(ours) == TOOL and outdir.file_problem(ours, TOOL) is None
    plan_json = tmp_path / "plan.json"
    assert main(["+experiment=tiny", "--json", str(plan_json)]) == 0
    assert main(["+experiment=tiny", "--json", str(plan_json), "--png", str(tmp_path / "plan.png")]) == 0
    assert outdir.written_by(tmp_path / "plan.png") == TOOL and json.loads(plan_json.read_text())["requested"]
