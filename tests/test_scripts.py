"""The setup scripts' first run (issue 33): on a machine where nothing was set up before,
every state file a script reads (a config, a key, a cell, an image) does not exist yet. Each
script's read-only and config-writing steps run here with their paths pointed at empty
temporary directories (the `--configure-only` modes start no daemon), twice: the second run
finds what the first wrote and changes nothing. And no script dies silently: every one of
them sources scripts/lib.sh, whose ERR trap names the script, the line and the command.

Those runs are traced: every program on the system's PATH runs behind a shim that logs it,
and each program a script ran must come from a package every Debian system has (Essential,
or of priority required) or from one the script installs with `need` or `need_packages`
(or a package that one depends on). Before, nothing installed the `tini` that
`slurm-nodes` runs, nor the `pgrep` (procps) of `start-sge`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, have, holding_scheduler, need, slurm_answers

SCRIPTS = REPO / "scripts"
SGE_INSTALLED = Path("/var/lib/gridengine")  # the package's files, the cell beside them
SYSTEM_BIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
CALLS = {"start-slurm": ("slurm-nodes",)}  # a script another runs: its declarations count too
pytestmark = pytest.mark.slow


def run(
    *argv: str | Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


class Traced:
    """Runs scripts from scripts/ with every program of the system's PATH behind a shim
    that logs it; `assert_installed` then checks what they ran."""

    def __init__(self, root: Path) -> None:
        self.log = root / "ran.log"
        shims = root / "shims"
        shims.mkdir(parents=True)
        self.log.touch(mode=0o666)  # a script may run a program as another user (su)
        self.log.chmod(0o666)
        for directory in SYSTEM_BIN:
            for entry in os.scandir(directory):
                shim = shims / entry.name
                if shim.exists() or entry.is_dir() or not os.access(entry.path, os.X_OK):
                    continue
                real = shlex.quote(entry.path)
                log = shlex.quote(str(self.log))
                shim.write_text(f'#!/bin/sh\necho "$TRACED_SCRIPT" {real} >>{log}\nexec {real} "$@"\n')
                shim.chmod(0o755)
        rest = [d for d in os.environ["PATH"].split(os.pathsep) if d not in SYSTEM_BIN]
        self.path = os.pathsep.join([*rest, str(shims)])

    def __call__(
        self, script: str, *args: str | Path, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``script``; what it runs, and what scripts it calls run, is logged as its."""
        return ok(
            run(SCRIPTS / script, *args, env={**(env or {}), "PATH": self.path, "TRACED_SCRIPT": script})
        )

    def assert_installed(self) -> None:
        ran: dict[str, set[str]] = {}
        for line in self.log.read_text().splitlines():
            script, program = line.split(" ", 1)
            ran.setdefault(script, set()).add(program)
        assert ran, "the shims logged nothing"
        missing: dict[str, str] = {}
        for script, programs in ran.items():
            allowed = base_and_declared([script, *CALLS.get(script, ())])
            for program in sorted(programs):
                if not packages_of(program) & allowed:
                    missing[f"{script}: {program}"] = " or ".join(sorted(packages_of(program)))
        assert not missing, f"programs run that no script installs: {missing}"


def packages_of(program: str) -> set[str]:
    """The Debian packages that give a program: the one its file belongs to (merged /usr:
    /bin/x is /usr/bin/x), or for a name chosen through /etc/alternatives (awk), each package
    that offers it."""
    link = os.readlink(program) if os.path.islink(program) else ""
    if link.startswith("/etc/alternatives/"):
        offered = subprocess.run(
            ["update-alternatives", "--list", os.path.basename(link)], capture_output=True, text=True
        )
        return {p for path in offered.stdout.split() for p in packages_of(path)}
    names = {program, os.path.realpath(program)}
    names |= {n.removeprefix("/usr") if n.startswith("/usr/") else "/usr" + n for n in list(names)}
    for name in sorted(names):
        found = subprocess.run(["dpkg", "-S", name], capture_output=True, text=True)
        if found.returncode == 0:
            return {found.stdout.split(":")[0]}
    return {f"(no package has {program})"}


def base_and_declared(scripts: list[str]) -> set[str]:
    """Essential and required packages, and those the scripts declare, with what they need."""
    fields = "${Package}\t${Priority}\t${Essential}\t${Pre-Depends}, ${Depends}\n"
    rows = subprocess.run(["dpkg-query", "-W", "-f", fields], capture_output=True, text=True, check=True)
    depends: dict[str, set[str]] = {}
    allowed: set[str] = set()
    for row in rows.stdout.splitlines():
        name, priority, essential, deps = row.split("\t")
        name = name.split(":")[0]
        depends[name] = {d.split()[0].split(":")[0] for d in re.split(r"[,|]", deps) if d.strip()}
        if priority == "required" or essential == "yes":
            allowed.add(name)
    todo = [package for script in scripts for package in declared(SCRIPTS / script)]
    while todo:
        package = todo.pop()
        if package not in allowed:
            allowed.add(package)
            todo += depends.get(package, ())
    return allowed


def declared(script: Path) -> list[str]:
    """The packages named by a script's `need PROGRAM:PACKAGE ...` and `need_packages PACKAGE ...`."""
    found = []
    for line in script.read_text().replace("\\\n", " ").splitlines():
        words = line.split("#")[0].split()
        if words[:1] == ["need"]:
            found += [w.split(":", 1)[1] for w in words[1:] if ":" in w]
        elif words[:1] == ["need_packages"]:
            found += [w for w in words[1:] if not w.startswith("-")]
    return found


@pytest.fixture
def traced(tmp_path: Path) -> Traced:
    return Traced(tmp_path / "trace")


def need_root() -> None:
    need(
        "root (the setup scripts install packages and write system files)",
        os.geteuid() == 0,
        "scripts/test as root",
    )


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_every_script_sources_the_shared_strict_mode_first() -> None:
    """lib.sh's ERR trap holds only where it is sourced before the first command runs."""
    for script in sorted(SCRIPTS.iterdir()):
        if script.name == "lib.sh":
            continue
        lines = [ln for ln in script.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        assert lines[0] == '. "$(dirname "$0")/lib.sh"', f"{script.name} starts with {lines[0]!r}"


def test_a_failing_command_names_the_script_line_and_command(tmp_path: Path) -> None:
    """Before lib.sh, `set -e` ended a script at a failing `sed` with no word (the first run of
    start-slurm on a bare machine exited 2 after 'installing ...')."""
    shutil.copy(SCRIPTS / "lib.sh", tmp_path / "lib.sh")
    script = tmp_path / "setup-thing"
    script.write_text(
        '#!/usr/bin/env bash\n. "$(dirname "$0")/lib.sh"\n'
        "count() { sed -n p /nonexistent/slurm.conf | head -n 1; }\n"
        "if ! grep -q x /nonexistent/file 2>/dev/null; then echo tolerated; fi\n"
        "seen=$(false; echo still here)\n"  # bash runs $(...) without -e: not an error
        'echo "$seen"\n'
        "count\n"
        "echo not reached\n"
    )
    script.chmod(0o755)
    result = run(script)
    assert result.returncode == 2
    assert result.stdout == "tolerated\nstill here\n"
    assert "setup-thing: line 3: `head -n 1` failed with status 2" in result.stderr, result.stderr


def test_slurm_nodes_counts_no_nodes_where_slurm_conf_does_not_exist_yet(
    tmp_path: Path, traced: Traced
) -> None:
    """The bare machine's first failure: `start-slurm` asked `slurm-nodes count` before it
    wrote slurm.conf, sed exited 2 on the missing file, and set -e ended both scripts."""
    conf = tmp_path / "slurm.conf"
    assert traced("slurm-nodes", "count", env={"SLURM_CONF": str(conf)}).stdout == "0\n"
    conf.write_text(traced("slurm-nodes", "conf", "3", "1024").stdout)
    assert traced("slurm-nodes", "count", env={"SLURM_CONF": str(conf)}).stdout == "3\n"
    traced.assert_installed()


def test_start_slurm_configures_an_empty_etc_and_keeps_it(tmp_path: Path, traced: Traced) -> None:
    need_root()
    need("Slurm's packages", have("slurmd") and have("mungekey"), "scripts/start-slurm")
    etc = tmp_path / "etc-slurm"
    env = {"SLURM_CONF": str(etc / "slurm.conf"), "MUNGE_KEY": str(tmp_path / "munge" / "munge.key")}
    first = traced("start-slurm", "--configure-only", "--nodes", "2", env=env)
    assert "nothing started" in first.stderr
    conf = (etc / "slurm.conf").read_text()
    assert re.search(r"^NodeName=\S+ NodeAddr=127\.0\.0\.1 ", conf, re.M), conf
    assert "PartitionName=multi Nodes=node[1-2] " in conf
    assert "IgnoreSystemd=yes" in (etc / "cgroup.conf").read_text()
    assert mode(etc / "prolog") == 0o755 and f"Prolog={etc}/prolog" in conf
    dbd = etc / "slurmdbd.conf"
    assert mode(dbd) == 0o600 and re.search(r"^StoragePass=[0-9a-f]{32}$", dbd.read_text(), re.M)
    key = tmp_path / "munge" / "munge.key"
    assert mode(key) == 0o400 and key.stat().st_size > 0
    assert traced("slurm-nodes", "count", env=env).stdout == "2\n"

    before = {p.name: p.read_bytes() for p in etc.iterdir()}
    again = traced("start-slurm", "--configure-only", env=env)  # no --nodes: keeps 2
    assert "writing" not in again.stderr and "creating" not in again.stderr, again.stderr
    assert {p.name: p.read_bytes() for p in etc.iterdir()} == before
    traced.assert_installed()


def test_start_sge_initialises_a_cell_that_does_not_exist() -> None:
    """The cell as it is when debconf said "no": the package's files, no cell, no spool."""
    need_root()
    need("Son of Grid Engine's packages", (SGE_INSTALLED / "utilbin").is_dir(), "scripts/start-sge")
    # init_cluster runs as sgeadmin, who cannot enter pytest's private tmp_path.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="chainrun-sge-") as name:
        Path(name).chmod(0o755)
        traced = Traced(Path(name) / "trace")
        first_run_of_a_cell(Path(name), traced)
        traced.assert_installed()


def first_run_of_a_cell(tmp_path: Path, traced: Traced) -> None:
    root = tmp_path / "sge-root"
    root.mkdir()
    for part in ("bin", "lib", "util", "utilbin"):
        (root / part).symlink_to(SGE_INSTALLED / part)
    env = {"CHAINRUN_SGE_ROOT": str(root), "CHAINRUN_SGE_SPOOL": str(tmp_path / "spool")}
    first = traced("start-sge", "--configure-only", env=env)
    assert "initialising the cell" in first.stderr
    common = root / "default" / "common"
    host = (common / "act_qmaster").read_text().strip()
    assert host and (common / "host_aliases").read_text() == f"{host} localhost\n"
    assert (common / "bootstrap").is_file() and (tmp_path / "spool" / "spooldb" / "sge").exists()
    again = traced("start-sge", "--configure-only", env=env)
    assert "initialising" not in again.stderr, again.stderr


def test_start_sshd_writes_keys_and_configs_into_an_empty_base(tmp_path: Path, traced: Traced) -> None:
    need_root()
    need("OpenSSH's server", Path("/usr/sbin/sshd").exists(), "scripts/start-sshd")
    base = tmp_path / "base"
    env = {"CHAINRUN_TEST_BASE": str(base)}
    traced("start-sshd", "--configure-only", env=env)
    client, server = base / "ssh", base / "sshd"
    assert mode(client) == 0o700
    for private in ("id_ed25519", "known_hosts", "config"):
        assert mode(client / private) == 0o600, private
    assert f"IdentityFile {client}/id_ed25519" in (client / "config").read_text()
    assert (client / "known_hosts").read_text().startswith("[127.0.0.1]:2222 ")
    ok(run("/usr/sbin/sshd", "-t", "-f", server / "sshd_config"))
    key = (client / "id_ed25519").read_bytes()
    traced("start-sshd", "--configure-only", env=env)
    assert (client / "id_ed25519").read_bytes() == key  # kept, not made anew
    traced.assert_installed()


def test_build_test_image_builds_into_an_empty_directory_then_only_names_it(
    tmp_path: Path, traced: Traced
) -> None:
    need_root()
    need("Charliecloud", have("ch-run"), "scripts/build-test-image")
    image = tmp_path / "images" / "image"
    env = {"CHAINRUN_TEST_IMAGE": str(image)}
    first = traced("build-test-image", env=env)
    assert first.stdout.splitlines()[-1] == str(image)
    inside = ok(run("ch-run", image, "--", "cat", "/etc/chainrun-test-image", env={"USER": "root"}))
    assert inside.stdout.startswith("chainrun test image ")
    again = traced("build-test-image", env=env)
    assert again.stdout == f"{image}\n"
    traced.assert_installed()


def test_lab_machine_makes_its_identity_in_a_directory_that_does_not_exist(
    tmp_path: Path, traced: Traced
) -> None:
    need_root()
    state = tmp_path / "machines" / "m1"
    show = ("bash", "-c", "hostname; cat /etc/machine-id")
    first = traced("lab-machine", "lab-m1", state, *show).stdout.split()
    identity = (state / "machine-id").read_text().strip()
    assert first == ["lab-m1", identity] and re.fullmatch(r"[0-9a-f]{32}", identity)
    assert traced("lab-machine", "lab-m1", state, *show).stdout.split() == first
    traced.assert_installed()


def test_a_second_run_of_each_start_script_only_verifies(traced: Traced) -> None:
    """What scripts/test runs before every suite, on the schedulers it started: each script
    finds its daemons up and starts nothing (the nodes' namespaces, links and slurmds too),
    running only programs it installs. The schedulers are held shared, as every test holds
    them, so none is down for a test that takes it down meanwhile."""
    need_root()
    with holding_scheduler("slurm"), holding_scheduler("slurm-nodes"), holding_scheduler("sge"):
        need("the test Slurm with its nodes", slurm_answers(), "scripts/start-slurm --nodes 3")
        assert "starting" not in traced("start-slurm").stderr
        assert "starting" not in traced("slurm-nodes", "start", "node1").stderr
        assert "starting" not in traced("start-sge").stderr
        assert "already up" in traced("start-sshd").stdout
    traced.assert_installed()
