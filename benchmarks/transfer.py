"""What a verified checkpoint move costs (issue 39): ``move_checkpoint`` against a plain copy.

A checkpoint of ``--size-mb`` random bytes is saved by the helper (``CheckpointDir.save``: a
tree digest), then moved local -> local, local -> SSH and SSH -> local (the test sshd of
``scripts/start-sshd``) by ``move_checkpoint``, which streams the bytes through this machine,
hashes them on the way, hashes the written copy again where it was written, and renames it
into place. The baseline is the same bytes copied without any check: ``shutil.copyfile`` and
an fsync here, paramiko's own ``SFTPClient.put`` / ``get`` over SSH (put pipelined, get
prefetched). The ways run interleaved within each repetition; the table gives medians and the
ratio to the baseline of the same direction.

    .venv/bin/python benchmarks/transfer.py [--size-mb 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chainrun.checkpoint import CheckpointDir
from chainrun.transfer import move_checkpoint
from chainrun.transport import SSHTransport, transport_for

SSH_CONFIG = "/var/lib/chainrun-test/ssh/config"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["CHAINRUN_SSH_CONFIG"] = SSH_CONFIG
    ssh = SSHTransport("crtest-local")
    local = transport_for(None)
    home = ssh.run(["sh", "-c", 'printf %s "$HOME"']).stdout
    remote = f"{home}/chainrun-transfer-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "src")
        store = CheckpointDir(src, suffix=".bin", keep=1)
        saved = store.save(os.urandom(args.size_mb << 20), epoch=1, step=0)
        store.wait()
        name = saved.file
        ssh.makedirs(remote)
        move_checkpoint(local, str(src), ssh, remote)  # the SSH side's source, and a warm-up
        sftp = ssh._connection().client.open_sftp()

        def fresh(path: Path) -> Path:
            shutil.rmtree(path, ignore_errors=True)
            return path

        def plain_local() -> None:
            target = fresh(Path(tmp, "plain")) / name
            target.parent.mkdir()
            shutil.copyfile(src / name, target)
            with open(target, "rb") as f:
                os.fsync(f.fileno())

        ways: dict[str, Callable[[], object]] = {
            "local -> local: move_checkpoint": lambda: move_checkpoint(
                local, str(src), local, str(fresh(Path(tmp, "moved")))
            ),
            "local -> local: copyfile + fsync": plain_local,
            "local -> SSH: move_checkpoint": lambda: move_checkpoint(
                local, str(src), ssh, f"{remote}/moved-{uuid.uuid4().hex[:6]}"
            ),
            "local -> SSH: paramiko put": lambda: sftp.put(
                str(src / name), f"{remote}/put-{uuid.uuid4().hex[:6]}"
            ),
            "SSH -> local: move_checkpoint": lambda: move_checkpoint(
                ssh, remote, local, str(fresh(Path(tmp, "back")))
            ),
            "SSH -> local: paramiko get": lambda: sftp.get(f"{remote}/{name}", str(Path(tmp, "got"))),
        }
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, run in ways.items():
                began = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - began)
            ssh.run(["sh", "-c", f"rm -rf {remote}/moved-* {remote}/put-*"])
        sftp.close()
        ssh.run(["rm", "-rf", remote])
    load = os.getloadavg()[0]
    print(f"{args.size_mb} MiB checkpoint, {args.repeats} repetitions, load average {load:.1f} (2 cores)\n")
    print("| way | median s | MB/s | x plain copy | spread s |")
    print("|---|---|---|---|---|")
    ways_list = list(times)
    for i, way in enumerate(ways_list):
        median = statistics.median(times[way])
        base = statistics.median(times[ways_list[i - i % 2 + 1]])
        rate = (args.size_mb << 20) / median / 1e6
        spread = f"{min(times[way]):.2f}-{max(times[way]):.2f}"
        print(f"| {way} | {median:.2f} | {rate:.0f} | {median / base:.2f} | {spread} |")


if __name__ == "__main__":
    main()
