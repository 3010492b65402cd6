"""Files written over SFTP: aside and then renamed (``sftp_aside``), or in pieces
(``SSHTransport.open_read`` and ``open_new``).

A checkpoint is gigabytes: it is never held in memory whole. A read keeps a bounded
number of requests in flight (``_IN_FLIGHT``), so the bytes come at the link's pace
and at most 2 MiB of them wait here; a write is pipelined
(requests go out without waiting for each answer, the SSH window bounds what is
unanswered) and ``commit`` flushes, sets the mtime, asks the server to fsync
(``fsync@openssh.com``) and closes. The stream uses the transport's SFTP session
outside its lock, so a drop under it is not retried: every error here becomes a
TransportError that names the host, the file and what was lost, and the caller
starts over (``chainrun.transfer`` does).
"""

from __future__ import annotations

import contextlib
import posixpath
import secrets
from collections import deque
from collections.abc import Iterator

import paramiko
from paramiko.sftp import CMD_DATA, CMD_EXTENDED, CMD_READ, int64

from chainrun.errors import TransportError
from chainrun.transport.base import oneline

__all__ = ["SFTPReader", "SFTPWriter", "sftp_aside", "sftp_fsync"]

_REQUEST = 32768  # bytes asked for per read request: the most every SFTP server answers
_IN_FLIGHT = 64  # read requests outstanding at once: 2 MiB on its way at most


def sftp_fsync(sftp: paramiko.SFTPClient, f: paramiko.SFTPFile) -> None:
    """Ask the server to fsync (OpenSSH's fsync@openssh.com); skip where unsupported."""
    with contextlib.suppress(OSError):  # no extension: the rename is still atomic
        sftp._request(CMD_EXTENDED, "fsync@openssh.com", f.handle)


def sftp_aside(sftp: paramiko.SFTPClient, p: str, data: bytes, mode: int) -> str:
    """``data`` written whole and durable to a private temp file beside ``p`` (created
    exclusively, ``mode`` set before any data lands), to be put into place; its path."""
    directory, base = posixpath.split(p)
    tmp = posixpath.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    try:
        with sftp.open(tmp, "wxb") as f:
            f.chmod(mode)
            f.set_pipelined(True)
            f.write(data)
            f.flush()
            sftp_fsync(sftp, f)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort: the original error matters
            sftp.remove(tmp)
        raise
    return tmp


@contextlib.contextmanager
def _lost(alias: str, what: str, path: str) -> Iterator[None]:
    try:
        yield
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise TransportError(
            f"ssh {alias}: cannot {what} {path} ({oneline(e) or 'connection closed'})"
        ) from None


class SFTPReader:
    """A remote file read in pieces, ``_IN_FLIGHT`` read requests ahead, in this thread.

    paramiko's own ``prefetch`` sends its requests from a thread of its own, which dies with
    a traceback on stderr when the link is cut; here the requests go out as the caller reads
    (SFTP's ``_async_request``, as paramiko's prefetch does), and answers that arrive while
    another is awaited come to ``_async_response``. The caller has checked it is a regular file.
    """

    def __init__(
        self, sftp: paramiko.SFTPClient, f: paramiko.SFTPFile, size: int, alias: str, path: str
    ) -> None:
        self._sftp, self._file, self._alias, self._path = sftp, f, alias, path
        self._size = size
        self._asked = 0  # the offset up to which reads are requested
        self._pending: deque[int] = deque()  # request numbers, in the file's order
        self._arrived: dict[int, tuple[int, paramiko.Message]] = {}

    def read(self, size: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        with _lost(self._alias, "read", self._path):
            while got < size:
                self._ask()
                if not self._pending:
                    break
                num = self._pending.popleft()
                while num not in self._arrived:
                    t, msg = self._sftp._read_response(num)
                    if t is not None and msg is not None:
                        self._arrived[num] = (t, msg)
                t, msg = self._arrived.pop(num)
                if t != CMD_DATA:
                    self._sftp._convert_status(msg)  # raises the server's error
                    raise EOFError("the file ended early")
                parts.append(msg.get_string())
                got += len(parts[-1])
        return b"".join(parts)

    def _ask(self) -> None:
        while self._asked < self._size and len(self._pending) < _IN_FLIGHT:
            n = min(_REQUEST, self._size - self._asked)
            handle = self._file.handle
            self._pending.append(self._sftp._async_request(self, CMD_READ, handle, int64(self._asked), n))
            self._asked += n

    def _async_response(self, t: int, msg: paramiko.Message, num: int) -> None:
        """paramiko hands over an answer that came while another was awaited."""
        self._arrived[num] = (t, msg)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a dead link may fail to close in any way
            self._file.close()


class SFTPWriter:
    """A new remote file written in pieces, pipelined."""

    def __init__(self, sftp: paramiko.SFTPClient, f: paramiko.SFTPFile, alias: str, path: str) -> None:
        self._sftp, self._file, self._alias, self._path = sftp, f, alias, path
        f.set_pipelined(True)

    def write(self, data: bytes) -> None:
        with _lost(self._alias, "write", self._path):
            self._file.write(data)

    def commit(self, mtime: float | None = None) -> None:
        with _lost(self._alias, "write", self._path):
            self._file.flush()
            if mtime is not None:
                self._file.utime((mtime, mtime))
            sftp_fsync(self._sftp, self._file)
            self._file.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # abandoned: the caller removes what is there
            self._file.close()
