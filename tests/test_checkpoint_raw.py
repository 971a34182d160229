"""The raw-bytes DCP storage: exact round trips across its buffer boundaries, every dtype and
layout a training state holds, reading back DCP's own format, and damage detected on read."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import raw
from hpctrain.checkpoint.safe import SafeReader, TensorOnlyLoadPlanner, check_files, read_metadata


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 77, generator=g),  # crosses several small buffers
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),  # odd byte count
        "step": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "view": torch.randn(40, 30, generator=g)[:, 5:17],  # non-contiguous
        "empty": torch.empty(0, 3),
        "flags": torch.rand(33, generator=g) > 0.5,
    }


def save(sd: dict, path, threads: int = 3, writer=raw.RawWriter) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=writer(str(path), thread_count=threads), no_dist=True)


def load(path, like: dict) -> dict:
    out = {k: torch.full_like(v.contiguous(), 3) if v.numel() else torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=SafeReader(str(path)), planner=TensorOnlyLoadPlanner(), no_dist=True)
    return out


@pytest.mark.parametrize("buffer", [4096, 16 << 20])
def test_round_trip_is_exact(tmp_path, monkeypatch, buffer):
    monkeypatch.setattr(raw, "BUFFER", buffer)
    sd = state()
    save(sd, tmp_path / "ck")
    back = load(tmp_path / "ck", sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    files = sorted(p.name for p in (tmp_path / "ck").glob("__*"))
    assert files == ["__0_0.raw"]  # one file per rank, written by 3 threads in aligned regions
    md = read_metadata(tmp_path / "ck")
    check_files(tmp_path / "ck", md)
    # No item overlaps another, and each thread's region starts on an O_DIRECT boundary.
    spans = sorted((i.offset, i.offset + i.length) for i in md.storage_data.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    starts = [a for a, _ in spans if a % raw.ALIGN == 0]
    assert len(starts) >= 3
    # The file ends with the last byte of data: the last O_DIRECT tail padding is cut off again.
    data = sum(v.numel() * v.element_size() for v in sd.values())
    size = (tmp_path / "ck" / "__0_0.raw").stat().st_size
    assert size == max(b for _, b in spans) and data <= size < data + 3 * raw.ALIGN


def test_reads_checkpoints_written_by_dcp_itself(tmp_path):
    sd = state()
    save(sd, tmp_path / "ck", writer=dcp.FileSystemWriter)
    assert list((tmp_path / "ck").glob("*.distcp"))
    back = load(tmp_path / "ck", sd)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_loads_a_slice_of_a_stored_tensor(tmp_path):
    """Resharding reads part of a stored chunk: a plain tensor loaded as a row-sharded DTensor is
    what DCP asks for; here a narrower read plan stands in for it."""
    sd = {"w": torch.arange(60.0).reshape(6, 10)}
    save(sd, tmp_path / "ck")
    md = read_metadata(tmp_path / "ck")
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    class Planner:
        def __init__(self):
            self.out = torch.zeros(2, 10)

        def resolve_tensor(self, req):
            return self.out

        def commit_tensor(self, req, t):
            self.committed = t

    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", (0, 0)), dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex("w", (0, 0)), storage_offsets=torch.Size([3, 0]),
                    lengths=torch.Size([2, 10]))
    p = Planner()
    raw.read_raw(str(tmp_path / "ck"), md, md.storage_data, [item], p)
    assert torch.equal(p.committed, sd["w"][3:5])


def test_truncated_raw_file_is_an_error_not_garbage(tmp_path):
    sd = {"w": torch.randn(1000)}
    save(sd, tmp_path / "ck", threads=1)
    f = tmp_path / "ck" / "__0_0.raw"
    f.write_bytes(f.read_bytes()[:1000])  # one tensor, one thread: it starts at 0
    with pytest.raises(Exception, match="truncated"):
        check_files(tmp_path / "ck")
    with pytest.raises(BaseException, match="__0_0.raw is truncated: it ends at byte 1000"):
        load(tmp_path / "ck", sd)


def test_refuses_to_overwrite_files(tmp_path):
    """Each save writes into a fresh directory; an existing data file means two writers collided."""
    sd = {"w": torch.randn(10)}
    save(sd, tmp_path / "ck", threads=1)
    with pytest.raises(BaseException, match="File exists"):
        save(sd, tmp_path / "ck", threads=1)


def test_stager_snapshots_into_buffers_it_reuses():
    from hpctrain.checkpoint.stager import ReusingStager

    w, step = torch.randn(4, 3), torch.tensor(5)
    src = {"model": {"w": w}, "optim": {"w": {"step": step, "exp_avg": torch.randn(4, 3)[:, :2]}}}
    st = ReusingStager()
    first = st.stage(src)
    snap = first["model"]["w"].clone()
    assert torch.equal(snap, w) and first["model"]["w"].data_ptr() != w.data_ptr()
    assert torch.equal(first["optim"]["w"]["exp_avg"], src["optim"]["w"]["exp_avg"])
    w.add_(1)  # the next training step changes the source: the snapshot does not move
    step += 1
    assert torch.equal(first["model"]["w"], snap) and int(first["optim"]["w"]["step"]) == 5
    second = st.stage(src)
    assert second is first and second["model"]["w"] is first["model"]["w"]  # nothing re-allocated
    assert torch.equal(second["model"]["w"], w) and int(second["optim"]["w"]["step"]) == 6
    src["model"]["w"] = torch.randn(5, 3)  # another shape: buffers are rebuilt
    third = st.stage(src)
    assert third["model"]["w"].shape == (5, 3) and torch.equal(third["model"]["w"], src["model"]["w"])
