"""The compiled-kernel cache is a directory of this user's own: a process loads the shared objects it
finds there, so a directory others can write to is never used (it was ./outputs/cache, under whatever
directory the run started in)."""
from __future__ import annotations

import os

from hpctrain.offload import kernel_cache


def test_the_cache_is_private_and_outside_the_working_directory(tmp_path, monkeypatch):
    """Mutant: the old default, outputs/cache under the current directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    # set, then deleted: monkeypatch then restores the variable's state afterwards, whatever it sets
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    path = kernel_cache.use_private_cache("TORCH_EXTENSIONS_DIR", "torch_extensions")
    assert path == str(tmp_path / "home-cache" / "hpctrain" / "torch_extensions")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == path
    assert not (tmp_path / "outputs").exists()
    for d in (path, os.path.dirname(path)):
        assert os.stat(d).st_mode & 0o777 == 0o700


def test_a_directory_others_can_write_is_not_used(tmp_path, monkeypatch, caplog):
    """Mutant: using the cache directory without checking its mode (another user's .so gets loaded)."""
    shared = tmp_path / "shared" / "hpctrain" / "inductor"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    path = kernel_cache.private_dir("inductor", base=str(tmp_path / "shared"))
    assert path != str(shared) and os.path.isdir(path) and os.stat(path).st_mode & 0o077 == 0
    assert "group or others may write" in caplog.text and str(shared) in caplog.text


def test_a_parent_others_can_write_is_not_used(tmp_path, caplog):
    """Someone who can write the hpctrain directory can swap the kernel directory inside it."""
    parent = tmp_path / "shared" / "hpctrain"
    (parent / "inductor").mkdir(parents=True, mode=0o700)
    os.chmod(parent, 0o777)
    assert kernel_cache.private_dir("inductor", base=str(tmp_path / "shared")) != str(parent / "inductor")


def test_a_variable_the_user_set_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.use_private_cache("TORCHINDUCTOR_CACHE_DIR", "inductor") == str(tmp_path / "mine")


def test_a_directory_of_another_user_is_not_used(tmp_path, caplog):
    """Mutant: no owner check (the directory is 0700 but someone else's, who put their .so there)."""
    if os.getuid() != 0:
        from helpers import skip_or_fail
        skip_or_fail("giving a directory to another user needs root", "the kernel-cache owner test")
    theirs = tmp_path / "c" / "hpctrain" / "torch_extensions"
    theirs.mkdir(parents=True, mode=0o700)
    os.chown(theirs, 4242, 4242)
    assert kernel_cache.private_dir("torch_extensions", base=str(tmp_path / "c")) != str(theirs)
    assert "belongs to uid 4242" in caplog.text
