"""The database's schema: the migrations that make each version from the one before.

Version ``i + 1`` is ``MIGRATIONS[i]`` applied to version ``i``; index 0 creates the schema.
``version`` reads which one a database has (0: no chainrun tables yet).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

from chainrun.store.rows import brief

# Migrations from version i to i+1 are MIGRATIONS[i]; index 0 creates the schema.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE chains (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        failures INTEGER NOT NULL DEFAULT 0,
        used REAL NOT NULL DEFAULT 0,
        progress TEXT,
        latest TEXT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        ended_at REAL
    );
    CREATE TABLE segments (
        chain_id TEXT NOT NULL REFERENCES chains(id),
        n INTEGER NOT NULL,
        walltime INTEGER NOT NULL,
        phase TEXT NOT NULL,
        job_id TEXT,
        after TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        retry_at REAL,
        submitted_at REAL,
        started_at REAL,
        ended_at REAL,
        missing_since REAL,
        outcome TEXT,
        exit_code INTEGER,
        charged INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (chain_id, n)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        chain_id TEXT NOT NULL,
        segment INTEGER,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_by_chain ON events (chain_id, id);
    """,
    # 2: the progress already in checkpoint_dir at submission, so the epoch rate
    # counts only what the chain trained (NULL for older chains: from epoch 0).
    "ALTER TABLE chains ADD COLUMN baseline TEXT",
    # 3: the last lines of a failed segment's output (JSON list), from its end marker.
    "ALTER TABLE segments ADD COLUMN tail TEXT",
    # 4: the tick reads only the active chains, and of those only the ones whose row or
    # segments changed since its last load (``version``, counted by triggers, so that a
    # change made by hand is seen too); `status` reads only the chains it shows.
    """
    CREATE INDEX chains_by_state ON chains (state, ended_at);
    CREATE INDEX chains_by_name ON chains (name, created_at);
    ALTER TABLE chains ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    CREATE TRIGGER chain_changed AFTER UPDATE ON chains WHEN NEW.version IS OLD.version BEGIN
        UPDATE chains SET version = version + 1 WHERE rowid = NEW.rowid;
    END;
    CREATE TRIGGER segment_added AFTER INSERT ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id = NEW.chain_id;
    END;
    CREATE TRIGGER segment_changed AFTER UPDATE ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id IN (OLD.chain_id, NEW.chain_id);
    END;
    CREATE TRIGGER segment_removed AFTER DELETE ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id = OLD.chain_id;
    END
    """,
    # 5: the host a pool placed each segment on (NULL: the chain's scheduler.host).
    "ALTER TABLE segments ADD COLUMN host TEXT",
    # 6: the array job (its name) and task a first segment was journaled as, so that a
    # crash between journal and submission finds the task, or submits that task again.
    """
    ALTER TABLE segments ADD COLUMN array TEXT;
    ALTER TABLE segments ADD COLUMN task INTEGER
    """,
    # 7: accounting and the web page's curves: when the signal reached a segment's
    # command (its end marker), so that the time it ran splits into training and the save
    # after the signal; and each new progress a tick saw (JSON, as ``chains.latest``).
    """
    ALTER TABLE segments ADD COLUMN signalled_at REAL;
    CREATE TABLE progress_log (chain_id TEXT NOT NULL, at REAL NOT NULL, progress TEXT NOT NULL);
    CREATE INDEX progress_by_chain ON progress_log (chain_id, at)
    """,
    # 8 (marked 7 for a while, see ``version``): the seconds each segment needed to stop
    # (signal to exit, or its save), of which an adaptive grace is made (decide/grace.py).
    "ALTER TABLE segments ADD COLUMN stop REAL",
    # 9: when a cancel was asked for: the segment running then has its grace to save and end.
    "ALTER TABLE chains ADD COLUMN cancel_requested_at REAL",
    # 10: when a segment's command was ready for the walltime signal (its end marker): how
    # long its start took, which status warns of when it eats the segments (decide/startup.py).
    "ALTER TABLE segments ADD COLUMN ready_at REAL",
    # 11: a chain with several places ([[cluster]]): the place each segment runs at (NULL:
    # the first), and the checkpoint copied there before it was submitted (seconds, bytes, digest).
    """
    ALTER TABLE segments ADD COLUMN place TEXT;
    ALTER TABLE segments ADD COLUMN copy_seconds REAL;
    ALTER TABLE segments ADD COLUMN copy_bytes INTEGER;
    ALTER TABLE segments ADD COLUMN copy_digest TEXT
    """,
    # 12: the cancels that did not reach their scheduler (its controller or host did not
    # answer), by cluster (scheduler kind, host; "" for this machine), each with its chain and
    # segment and since when: sent once that cluster answers, by whichever service runs then.
    """
    CREATE TABLE owed_cancels (
        kind TEXT NOT NULL,
        host TEXT NOT NULL,
        job_id TEXT NOT NULL,
        chain_id TEXT NOT NULL,
        n INTEGER NOT NULL,
        since REAL NOT NULL,
        PRIMARY KEY (kind, host, job_id)
    )
    """,
    # 13: the name each job owed a cancel was listed with: the cancel is sent to the job
    # listed under that id with that name, never to another that took its id (a cluster
    # back with its state lost). Those owed before: the tag their segment's job was given.
    """
    ALTER TABLE owed_cancels ADD COLUMN name TEXT NOT NULL DEFAULT '';
    UPDATE owed_cancels SET name = 'cr.' || chain_id || '.' || n
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def statements(script: str) -> Iterator[str]:
    """The SQL statements of ``script``, split where each one is complete (a trigger's
    body holds semicolons of its own)."""
    statement = ""
    for part in script.split(";"):
        statement += part + ";"
        if sqlite3.complete_statement(statement):
            if statement.strip(" \n;"):
                yield statement
            statement = ""


def version(db: sqlite3.Connection) -> int:
    """The schema version of the database; 0 for one without chainrun's tables."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone():
        return 0
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        return 0
    try:
        found = int(row["value"])
    except (TypeError, ValueError):
        raise sqlite3.DatabaseError(f"its schema version {brief(row['value'])} is not a number") from None
    # Two migrations were once both numbered 7 (the progress log, and the segments' stop
    # column), and every database made since was marked 7 with both: one with the column is at 8.
    if found == 7 and any(c["name"] == "stop" for c in db.execute("PRAGMA table_info(segments)")):
        return 8
    return found
