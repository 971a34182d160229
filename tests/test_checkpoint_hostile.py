"""Hostile checkpoint metadata: `.metadata` is a pickle, so everything in it is checked before a byte is
used. Each test writes a real checkpoint (DCP's own save, one process), then edits its metadata as an
attacker would, and runs the export tool on it (the resume path reads it through the same function)."""
from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import raw
from hpctrain.checkpoint.__main__ import export
from hpctrain.checkpoint.safe import DamagedCheckpoint, read_metadata


@pytest.fixture
def step_dir(tmp_path) -> Path:
    d = tmp_path / "run" / "checkpoints" / "step-00000004"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"norm.weight": torch.arange(8.0)}}, storage_writer=raw.RawWriter(str(d)), no_dist=True)
    return d


def rewrite(step_dir: Path, edit) -> None:
    """Unpickle the real metadata (it is ours), change a record, pickle it back."""
    md = pickle.loads((step_dir / ".metadata").read_bytes())
    edit(md)
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))


def refused(step_dir: Path, tmp_path: Path, *words: str) -> str:
    with pytest.raises(DamagedCheckpoint) as e:
        export(step_dir, tmp_path / "out.safetensors")
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "out.safetensors").exists()
    return str(e.value)


def test_the_unedited_checkpoint_exports(step_dir, tmp_path):
    flat = export(step_dir, tmp_path / "out.safetensors")
    assert torch.equal(flat["norm.weight"], torch.arange(8.0))


def _global(module: str, name: str) -> bytes:
    """Protocol-4 STACK_GLOBAL of module.name (name may hold dots: the unpickler walks them)."""
    enc = lambda s: b"\x8c" + bytes([len(s.encode())]) + s.encode()  # noqa: E731  SHORT_BINUNICODE
    return enc(module) + enc(name) + b"\x93"


@pytest.mark.parametrize("how", ["dotted-name", "getattr"])
def test_a_pickled_call_before_the_metadata_runs_nothing(step_dir, tmp_path, how):
    """Mutant: admitting globals by module prefix (torch.distributed.checkpoint.*) or builtins.getattr
    runs the command (the marker file appears) and the export succeeds on the real metadata behind it."""
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    enc = lambda s: b"\x8c" + bytes([len(s.encode())]) + s.encode()  # noqa: E731
    if how == "dotted-name":  # the reproduction from the review, byte for byte in shape
        call = _global("torch.distributed.checkpoint.filesystem", "os.system") + enc(cmd) + b"\x85R0"
    else:  # getattr(<a module reached by prefix>, "system")(cmd)
        call = (_global("builtins", "getattr") + _global("torch.distributed.checkpoint.filesystem", "os")
                + enc("system") + b"\x86R" + enc(cmd) + b"\x85R0")
    meta = step_dir / ".metadata"
    meta.write_bytes(b"\x80\x04" + call + meta.read_bytes())
    msg = refused(step_dir, tmp_path, "refusing to unpickle", str(meta))
    assert not marker.exists(), msg


def test_a_foreign_class_in_an_allowed_module_is_refused(step_dir, tmp_path):
    """Mutant: a module-prefix allow-list admits DCP's loader itself."""
    payload = pickle.dumps(dcp.state_dict_loader.load)
    (step_dir / ".metadata").write_bytes(payload)
    refused(step_dir, tmp_path, "refusing to unpickle torch.distributed.checkpoint.state_dict_loader.load")


def test_metadata_of_another_type_is_refused(step_dir, tmp_path):
    (step_dir / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    refused(step_dir, tmp_path, "holds a dict, not DCP's Metadata")


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_storage_outside_the_checkpoint_is_not_read(step_dir, tmp_path, where):
    """A relative_path of ../../secret.raw put a file's bytes into the export's norm.weight.
    Mutant: no confinement check (the secret's bytes are exported)."""
    secret = tmp_path / "secret.raw"
    secret.write_bytes(b"TOPSECRET" * 64)
    if where == "symlink":
        (step_dir / "link.raw").symlink_to(secret)
    target = {"parent": os.path.relpath(secret, step_dir), "absolute": str(secret), "symlink": "link.raw"}[where]

    def edit(md):
        md.storage_data = {k: dataclasses.replace(v, relative_path=target, offset=0)
                           for k, v in md.storage_data.items()}
    rewrite(step_dir, edit)
    refused(step_dir, tmp_path, "outside the checkpoint directory", repr(target))


def test_a_negative_byte_range_is_refused(step_dir, tmp_path):
    rewrite(step_dir, lambda md: md.storage_data.update(
        {k: dataclasses.replace(v, offset=-16) for k, v in md.storage_data.items()}))
    refused(step_dir, tmp_path, "offset -16")


def test_a_chunk_outside_its_tensor_is_refused(step_dir, tmp_path):
    """Mutant: no chunk check (torch fails deep in a narrow(), or reads past the tensor)."""
    def edit(md):
        item = md.state_dict_metadata["model.norm.weight"]
        item.chunks[0] = dataclasses.replace(item.chunks[0], offsets=torch.Size([4]))
    rewrite(step_dir, edit)
    refused(step_dir, tmp_path, "chunk of model.norm.weight", "outside its shape [8]")


def test_metadata_that_is_not_a_pickle_names_the_file(step_dir, tmp_path):
    (step_dir / ".metadata").write_bytes(b"\x00not a pickle")
    refused(step_dir, tmp_path, "is unreadable", ".metadata")


def test_the_allow_list_reads_every_record_dcp_writes(tmp_path):
    """Both writers (ours and DCP's) and every dtype a training state holds get through: the exact
    allow-list is not narrower than what DCP pickles. Mutant: dropping any entry DCP uses."""
    sd = {"f": torch.randn(3, 5), "b": torch.ones(4, dtype=torch.bfloat16), "i": torch.tensor(7),
          "flags": torch.zeros(2, dtype=torch.bool), "h": torch.zeros(1, dtype=torch.float16)}
    for i, writer in enumerate((raw.RawWriter, dcp.FileSystemWriter)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=writer(str(tmp_path / str(i))), no_dist=True)
        md = read_metadata(tmp_path / str(i))
        assert {k: tuple(v.size) for k, v in md.state_dict_metadata.items()} == {k: tuple(v.shape) for k, v in sd.items()}
        assert {v.properties.dtype for v in md.state_dict_metadata.values()} == {v.dtype for v in sd.values()}


# ------------------------------------------------------------ the single-file export's target

def test_a_file_the_export_did_not_write_is_not_overwritten(step_dir, tmp_path):
    """Mutant: the old export (torch.save / save_file straight over whatever was there)."""
    from hpctrain.core.outdir import OutputDirError

    for name in ("weights.pt", "model.safetensors"):
        theirs = tmp_path / name
        theirs.write_bytes(b"the user's own file")
        with pytest.raises(OutputDirError, match=f"{theirs} exists and was not written by this command. Fix: "):
            export(step_dir, theirs)
        assert theirs.read_bytes() == b"the user's own file"
    with pytest.raises(OutputDirError, match="is a directory. Fix: name a file"):
        export(step_dir, tmp_path)


def test_an_earlier_export_is_replaced_and_a_failed_one_keeps_it(step_dir, tmp_path, monkeypatch):
    """Its own earlier safetensors export is replaced; an export that fails part way leaves it whole.
    Mutant: writing in place (a failed save_file truncates the earlier export)."""
    import hpctrain.checkpoint.__main__ as tool

    out = tmp_path / "model.safetensors"
    export(step_dir, out)
    export(step_dir, out, dtype="bf16")  # its own: replaced
    before = out.read_bytes()

    def fail(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError("No space left on device")
    monkeypatch.setattr(tool, "save_file", fail)
    with pytest.raises(OSError):
        export(step_dir, out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "run"]
