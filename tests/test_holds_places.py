"""One chain per checkpoint directory, across places (issue 39): a chain with several places
holds the checkpoint directory of each of them, so a second chain whose directory at any of
its places is one at any place of a live chain is refused at submit, as a one-place chain is.

Before, the rule compared the first place's directory alone: two chains whose second places
trained into one directory were both accepted, and would have resumed from each other's
checkpoints once both moved there.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from test_holds import job

from chainrun.decide.holds import Hold, Holder
from chainrun.store import Store

CLI = Callable[..., subprocess.CompletedProcess[str]]
HERE = frozenset({""})


def places_job(work: Path, name: str, first: Path, second: Path) -> Path:
    """A job file with two places on this machine, checkpointing into ``first`` and ``second``."""
    path = job(work, name=name, checkpoint_dir=str(first))
    tables = "".join(
        f'[[cluster]]\nname = "{place}"\nkind = "local"\ncheckpoint_dir = {json.dumps(str(ckpt))}\n'
        for place, ckpt in (("one", first), ("two", second))
    )
    path.write_text(path.read_text() + tables)
    return path


def stored(home: Path) -> list[str]:
    store = Store(home, readonly=True)
    try:
        return [c.spec.name for c in store.chains()]
    finally:
        store.close()


def test_a_chain_whose_second_place_trains_where_a_live_chains_second_place_does_is_refused(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """Two job files whose first places' directories differ and whose second places' are one:
    the second is refused at check and submit, naming the chain and the place that holds it;
    nothing is stored. With a directory of its own at every place it is taken."""
    shared = tmp_path / "shared-ckpt"
    (chain_id,) = chainrun(
        "submit", str(places_job(tmp_path / "a", "a", tmp_path / "a-ckpt", shared)), check=True
    ).stdout.split()
    other = places_job(tmp_path / "b", "b", tmp_path / "b-ckpt", shared)
    for command in ("check", "submit"):
        refused = chainrun(command, str(other))
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(
            f"chainrun: {other}: checkpoint_dir {shared} (at place two) is where chain {chain_id} (a) "
            "still trains (at place two)"
        ), refused.stderr
    assert stored(home) == ["a"]
    # Its second place in the first's directory clashes as well: any place against any place.
    crossed = places_job(tmp_path / "c", "c", tmp_path / "c-ckpt", tmp_path / "a-ckpt")
    assert f"where chain {chain_id} (a) still trains" in chainrun("submit", str(crossed)).stderr
    own = places_job(tmp_path / "b", "b", tmp_path / "b-ckpt", tmp_path / "b-ckpt-2")
    assert len(chainrun("submit", str(own), check=True).stdout.split()) == 1
    assert stored(home) == ["a", "b"]


def test_one_chains_places_may_share_a_directory_and_resubmitting_it_returns_it(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """A chain's own places sharing one directory (one file system both reach) is no clash
    with itself; the same job file submitted again returns the chain still running."""
    path = places_job(tmp_path / "a", "a", tmp_path / "ckpt", tmp_path / "ckpt")
    (chain_id,) = chainrun("submit", str(path), check=True).stdout.split()
    again = chainrun("submit", str(path))
    assert again.returncode == 0 and again.stdout.split() == [chain_id], again.stderr
    assert f"a: still running as chain {chain_id}; left as it is" in again.stderr


def test_the_chain_met_is_found_by_any_of_the_new_chains_holds_against_any_of_a_live_ones() -> None:
    """``clashing``: each hold of the new chain (one per place) against each hold of the live
    chains; a live chain of the same job file in the same directory first, else any other."""
    from chainrun.decide.holds import clashing

    mine = (Hold(HERE, "/w/a"), Hold(HERE, "/w/shared"))
    first = Holder("x-1", "x", Hold(HERE, "/w/x"))
    second = Holder("x-1", "x", Hold(HERE, "/w/shared"), place="two")
    elsewhere = Holder("y-1", "y", Hold(frozenset({"gpu1"}), "/w/shared"), place="two")
    assert clashing("n", mine, [first, elsewhere]) is None
    assert clashing("n", mine, [first, second, elsewhere]) == (1, second)
    assert clashing("n", mine[:1], [first, second]) is None
    own = Holder("n-1", "n", Hold(HERE, "/w/a"))
    assert clashing("n", mine, [second, own]) == (0, own)  # its own job file's chain, first
    again = Holder("n-1", "n", Hold(HERE, "/w/shared"), place="two")
    other = Holder("o-1", "o", Hold(HERE, "/w/a"))
    assert clashing("n", mine, [other, again]) == (1, again)  # first, though at a later place
    stranger = Holder("s-1", "s", Hold(HERE, "/w/shared"), place="two")
    assert clashing("n", mine[1:], [stranger, again]) == (0, again)  # of two at one place, too
    inner = Holder("z-1", "z", Hold(HERE, "/w/shared/run1"), place="two")
    assert clashing("n", mine, [inner]) == (1, inner)
