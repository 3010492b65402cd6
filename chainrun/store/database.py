"""The database file: opened for writing (WAL, made private, upgraded) or for a look only,
every SQLite error turned into what it means for the user, and transactions.

A database that cannot be used for now (its disk full, read-only, locked by another
process) raises ``StoreUnavailable`` with what is wrong: an outage that the service waits
out, never a reason to charge a chain. A damaged file raises ``StoreError`` naming
``sqlite3 FILE .recover`` as the way out. Opened ``readonly`` (for the commands that only
look) it never writes, never waits on a writer for more than ``READ_TIMEOUT``, and a
missing database reads as one without chains.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from chainrun import home as state_home
from chainrun.errors import StoreError, StoreUnavailable, UsageError
from chainrun.store.migrations import MIGRATIONS, SCHEMA_VERSION, statements
from chainrun.store.migrations import version as stored_version
from chainrun.store.rows import text_factory

DB_FILE = "chainrun.db"
BUSY_TIMEOUT = 10.0  # seconds a statement waits for another process's write lock
READ_TIMEOUT = 1.0  # seconds a read-only command waits for a writer before saying it is busy


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed; refuse one others may enter or that is not ours
    (``chainrun.home``'s rule, the local runner's too)."""
    try:
        return state_home.private_dir(path)
    except state_home.HomeError as exc:
        raise UsageError(str(exc)) from None


def local_dir(path: Path) -> Path:
    """``private_dir``, refused on a network file system (``chainrun.home.mount_of``): SQLite's
    WAL keeps shared memory beside the database, and the service's flock on it turns into a
    whole-file POSIX lock over NFS that collides with SQLite's own; neither holds there."""
    mount = state_home.mount_of(path)
    if mount is not None and mount.network:
        raise UsageError(
            f"{state_home.short_path(path)} is on a network file system ({mount.kind} at {mount.point}),"
            " where chainrun's database and service lock do not hold: set CHAINRUN_HOME to a directory"
            " on this machine's own disk"
        )
    return private_dir(path)


class Database:
    """One SQLite file under ``home``; ``db`` is the connection."""

    def __init__(self, home: Path, readonly: bool = False) -> None:
        self.home = Path(home)
        self.path = self.home / DB_FILE
        self.readonly = readonly
        self.written = 0  # write transactions begun through this connection (``tx``)
        self.db = self._open_reader() if readonly else self._open_writer()

    def _open_writer(self) -> sqlite3.Connection:
        local_dir(self.home)
        # A new database is created private (0600; its -wal and -shm copy its mode);
        # an existing one keeps the mode it has.
        old_umask = os.umask(0o077)
        try:
            with self.sql():
                # The service ticks in a worker thread, one tick at a time.
                self.db = _connect(str(self.path), uri=False, timeout=BUSY_TIMEOUT)
        finally:
            os.umask(old_umask)
        try:
            with self.sql():
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except BaseException:
            self.db.close()
            raise
        return self.db

    def _open_reader(self) -> sqlite3.Connection:
        try:
            exists = self.home.exists()  # a file there is refused below, as for writing
        except OSError as exc:  # a name too long, say
            raise UsageError(
                f"cannot use the state directory {state_home.short_path(self.home)}: {exc.strerror}"
            ) from None
        if exists:
            private_dir(self.home)  # refused when open to others, as for writing (never created)
        try:
            os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return self._in_memory(None)  # no database yet: no chains
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.path}: {exc.strerror or exc}") from None
        uri = f"{self.path.absolute().as_uri()}?mode=ro"
        with self.sql():
            self.db = _connect(uri, uri=True, timeout=READ_TIMEOUT)
        try:
            with self.sql():
                try:
                    version = stored_version(self.db)
                except sqlite3.OperationalError as exc:
                    # A reader needs the -shm file beside a WAL database: on a read-only or full
                    # disk it cannot be made. With no -wal to merge, the file alone is the whole
                    # database, and nothing can be writing it without those two files.
                    text = f"{getattr(exc, 'sqlite_errorname', '')} {exc}".lower()
                    unopenable = any(w in text for w in ("cantopen", "unable to open", "ioerr", "i/o error"))
                    if not (unopenable and self._without_wal()):
                        raise
                    self.db.close()
                    self.db = _connect(uri + "&immutable=1", uri=True, timeout=READ_TIMEOUT)
                    version = stored_version(self.db)
            self._check_version(version)
        except BaseException:
            self.db.close()
            raise
        if version < SCHEMA_VERSION:
            # An older (or empty) database is read through an upgraded copy in memory:
            # the upgrade itself is left to the next chainrun that writes.
            old = self.db
            try:
                return self._in_memory(old)
            finally:
                old.close()
        return self.db

    def _in_memory(self, source: Optional[sqlite3.Connection]) -> sqlite3.Connection:
        self.db = _connect(":memory:", uri=False, timeout=READ_TIMEOUT)
        if source is not None:
            with self.sql():
                source.backup(self.db)
        self._migrate()
        return self.db

    def _without_wal(self) -> bool:
        try:
            return os.stat(f"{self.path}-wal").st_size == 0
        except FileNotFoundError:
            return True
        except OSError:
            return False

    @contextmanager
    def sql(self) -> Iterator[None]:
        """Turn what SQLite says of the database into a StoreError naming it; a misuse
        of SQLite (a bug) stays what it is."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError:
                raise self.fault(exc) from None
            raise

    def fault(self, exc: sqlite3.DatabaseError) -> StoreError:
        """What an SQLite error means for the user, named for what it is."""
        code = str(getattr(exc, "sqlite_errorname", ""))  # Python 3.11+
        text = f"{code} {exc}".lower()
        where = self.path
        if "corrupt" in text or "malformed" in text or "notadb" in text or "not a database" in text:
            quoted = shlex.quote(str(where))
            return StoreError(
                f"{where} is damaged ({exc}); chainrun cannot use it. Stop the service, then recover"
                f" what it holds: `sqlite3 {quoted} .recover > {quoted}.sql`, move {quoted} aside,"
                f" and `sqlite3 {quoted} < {quoted}.sql`"
            )
        cantopen = "cantopen" in text or "unable to open" in text
        ioerr = "ioerr" in text or "i/o error" in text
        if "full" in text or (ioerr and self._disk_full()):
            return StoreUnavailable(f"the disk holding {where} is full; free some space")
        if self._readonly_fs() and ("readonly" in text or "read-only" in text or cantopen or ioerr):
            return StoreUnavailable(f"{where} is on a read-only filesystem; chainrun needs to write it")
        if "readonly" in text or "read-only" in text:
            return StoreUnavailable(
                f"{where} is read-only; chainrun needs to write it (check its permissions and {self.home}'s)"
            )
        if "locked" in text or "busy" in text:
            if self.readonly:
                return StoreUnavailable(f"{where} is busy: another process is writing it; try again")
            return StoreUnavailable(f"{where} is locked by another process (waited {BUSY_TIMEOUT:g} s)")
        if cantopen:
            return StoreUnavailable(f"cannot open {where}: {exc}")
        if ioerr:
            return StoreUnavailable(f"cannot read or write {where}: {exc}")
        return StoreError(
            f"{where}: not a usable chainrun database ({exc}); "
            "move it aside and resubmit, or point CHAINRUN_HOME elsewhere"
        )

    def _disk_full(self) -> bool:
        try:
            return os.statvfs(self.home).f_bavail == 0
        except OSError:
            return False

    def _readonly_fs(self) -> bool:
        try:
            return bool(os.statvfs(self.home).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def close(self) -> None:
        self.db.close()

    def stamp(self) -> tuple[int, int]:
        """A pair that changes whenever the database may have changed: SQLite's
        ``data_version`` (another connection committed) and ``written`` (this one began a
        write transaction)."""
        return int(self.rows("PRAGMA data_version")[0][0]), self.written

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.written += 1
        with self.sql():
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.db.execute("ROLLBACK")
                raise

    @contextmanager
    def read_transaction(self) -> Iterator[None]:
        """Reads inside see the database as it was at the first one (WAL: no lock taken
        from writers), so a load's queries agree with each other."""
        with self.sql():
            self.db.execute("BEGIN")
        try:
            yield
        finally:
            with self.sql(), contextlib.suppress(sqlite3.Error):
                self.db.execute("COMMIT")

    def rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self.sql():
            return self.db.execute(sql, args).fetchall()

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: written by a newer chainrun (schema {version}, "
                f"this one knows {SCHEMA_VERSION}); upgrade chainrun"
            )

    def _migrate(self) -> None:
        with self.sql():
            version = stored_version(self.db)
        self._check_version(version)
        if version == SCHEMA_VERSION:
            return  # nothing to write: opening takes no write lock
        with self.tx() as db:
            version = stored_version(db)  # again under the lock: another process may have done it
            self._check_version(version)
            for step in MIGRATIONS[version:]:
                for statement in statements(step):
                    db.execute(statement)
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )


def _connect(target: str, uri: bool, timeout: float) -> sqlite3.Connection:
    db = sqlite3.connect(target, uri=uri, timeout=timeout, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.text_factory = text_factory
    return db
