"""A snapshot chain's working copy (chainrun.node.share), on real files: which of the files a
command made or changed go to the workdir, which go beside the workdir's own, and what of the
workdir (and its parents) the copy reaches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chainrun.node.share import BESIDE, Copy, share


def unpack(top: Path, files: dict[str, str]) -> tuple[Path, Path]:
    """A snapshot unpacked at ``top/pristine`` with its list of paths, as ``snapshot.deliver``
    leaves it; and where a chain's copy of it goes."""
    pristine = top / "pristine"
    names = set()
    for path, text in files.items():
        (pristine / path).parent.mkdir(parents=True, exist_ok=True)
        (pristine / path).write_text(text)
        parts = path.split("/")
        names |= {"/".join(parts[: i + 1]) for i in range(len(parts))}
    (pristine / ".chainrun-names").write_bytes(b"\0".join(sorted(n.encode() for n in names)))
    return pristine, top / "copy"


def settings(
    pristine: Path, copy: Path, workdir: Path, subdir: str = "", chain: str = "c1"
) -> dict[str, str]:
    return {
        "pristine": str(pristine),
        "copy": str(copy),
        "names": str(pristine / ".chainrun-names"),
        "subdir": subdir,
        "workdir": str(workdir),
        "chain": chain,
    }


@pytest.fixture
def chain(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """A snapshot with a tracked config and a tracked (empty of outputs) results directory,
    shared into a workdir that is a clone of it."""
    files = {"config.yaml": "lr: 0\n", "results/README": "results\n", "train.py": "pass\n"}
    pristine, copy = unpack(tmp_path, files)
    work = tmp_path / "work"
    for path, text in files.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    s = settings(pristine, copy, work)
    assert share(s) is not None
    return s, copy, work


def rewrite(path: Path, text: str) -> None:
    """What a command's atomic save does: a new file replaces whatever is there (a link too)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_what_the_command_made_or_changed_reaches_the_workdir_and_stays_visible_to_it(
    chain: tuple[dict[str, str], Path, Path],
) -> None:
    s, copy, work = chain
    rewrite(copy / "config.yaml", "lr: 1\n")  # a tracked file changed
    rewrite(copy / "results" / "out.csv", "1\n")  # a new file in a tracked directory
    (copy / "plots").mkdir()  # a new directory, moved whole
    (copy / "plots" / "a.png").write_text("png")
    done = share(s)
    assert done is not None and done.beside == [] and done.left == []
    assert (work / "config.yaml").read_text() == "lr: 1\n"
    assert (work / "results" / "out.csv").read_text() == "1\n"
    assert (work / "plots" / "a.png").read_text() == "png"
    assert all((copy / p).is_symlink() for p in ("config.yaml", "results/out.csv", "plots"))
    assert (copy / "results" / "out.csv").read_text() == "1\n"  # the next segment reads its own
    assert (copy / "train.py").read_text() == "pass\n" and not (copy / "train.py").is_symlink()
    # The next save replaces the file this chain put there: in place, not beside.
    rewrite(copy / "results" / "out.csv", "1\n2\n")
    done = share(s)
    assert done is not None and done.beside == []
    assert (work / "results" / "out.csv").read_text() == "1\n2\n"


def test_a_file_the_user_changed_meanwhile_stays_and_the_chains_goes_beside_it(
    chain: tuple[dict[str, str], Path, Path],
) -> None:
    s, copy, work = chain
    rewrite(work / "config.yaml", "lr: mine\n")  # the user's edit, after submit
    rewrite(copy / "config.yaml", "lr: 1\n")
    rewrite(copy / "results" / "out.csv", "1\n")
    share(s)
    rewrite(work / "results" / "out.csv", "the user's copy\n")  # replaced under the chain
    rewrite(copy / "results" / "out.csv", "1\n2\n")
    done = share(s)
    assert done is not None
    assert (work / "config.yaml").read_text() == "lr: mine\n"
    assert (work / "results" / "out.csv").read_text() == "the user's copy\n"
    assert done.beside == [str(work / "results" / f"out.csv{BESIDE}c1")]
    assert (work / f"config.yaml{BESIDE}c1").read_text() == "lr: 1\n"
    assert (work / "results" / f"out.csv{BESIDE}c1").read_text() == "1\n2\n"
    assert (copy / "config.yaml").read_text() == "lr: 1\n"  # the chain goes on with its own


def test_a_workdir_file_the_command_replaces_is_replaced_as_in_a_run_without_snapshot(
    chain: tuple[dict[str, str], Path, Path],
) -> None:
    s, copy, work = chain
    (work / "stats.json").write_text("{}")  # the workdir's own, linked in at the next share
    share(s)
    assert (copy / "stats.json").is_symlink()
    rewrite(copy / "stats.json", '{"n": 1}')
    done = share(s)
    assert done is not None and done.beside == []
    assert (work / "stats.json").read_text() == '{"n": 1}'


def test_two_chains_of_one_sweep_never_take_each_others_files(tmp_path: Path) -> None:
    pristine, _ = unpack(tmp_path, {"train.py": "pass\n"})
    work = tmp_path / "work"
    work.mkdir()
    a = settings(pristine, tmp_path / "a", work, chain="a")
    b = settings(pristine, tmp_path / "b", work, chain="b")
    share(a), share(b)
    (tmp_path / "a" / "out.csv.tmp").write_text("half")  # a's save, half written
    rewrite(tmp_path / "b" / "out.csv", "b\n")
    share(b)
    assert (tmp_path / "a" / "out.csv.tmp").read_text() == "half"
    assert not (work / "out.csv.tmp").exists()
    (tmp_path / "a" / "out.csv.tmp").rename(tmp_path / "a" / "out.csv")
    done = share(a)
    assert done is not None and done.beside == [str(work / f"out.csv{BESIDE}a")]
    assert (work / "out.csv").read_text() == "b\n"


def test_a_job_in_a_subdirectory_reaches_the_parents_data_and_brings_outputs_there(tmp_path: Path) -> None:
    """The repository's ``exp/`` runs in a workdir of another name (as on a remote host): the
    copy's top pairs with the workdir's parent, ``exp`` with the workdir."""
    pristine, copy = unpack(tmp_path, {"exp/train.py": "pass\n", "lib/util.py": "x = 1\n"})
    base = tmp_path / "cluster"
    (base / "data").mkdir(parents=True)
    (base / "data" / "x.txt").write_text("the data\n")
    work = base / "run 1"
    work.mkdir()
    (work / "local.txt").write_text("here\n")
    s = settings(pristine, copy, work, subdir="exp")
    share(s)
    assert (copy / "data" / "x.txt").read_text() == "the data\n"
    assert (copy / "exp" / "local.txt").read_text() == "here\n"
    assert not (copy / "run 1").exists(), "the workdir is paired with exp/, not linked beside it"
    assert (copy / "lib" / "util.py").read_text() == "x = 1\n" and not (copy / "lib").is_symlink()
    (copy / "results").mkdir()
    (copy / "results" / "all.csv").write_text("1\n")  # ../results/all.csv from exp/
    rewrite(copy / "exp" / "out.txt", "2\n")
    share(s)
    assert (base / "results" / "all.csv").read_text() == "1\n"
    assert (work / "out.txt").read_text() == "2\n"
    assert not (base / "exp").exists()


def test_what_cannot_be_brought_home_is_left_and_said(chain: tuple[dict[str, str], Path, Path]) -> None:
    s, copy, work = chain
    (work / "results" / "README").unlink()
    (work / "results").rmdir()
    (work / "results").write_text("a file where the chain has a directory\n")
    rewrite(copy / "results" / "out.csv", "1\n")
    copy_ = Copy(s)
    assert copy_.load()
    copy_.bring_home()
    assert len(copy_.left) == 1 and copy_.left[0].startswith(str(copy / "results" / "out.csv"))
    assert (copy / "results" / "out.csv").read_text() == "1\n"  # where it was
