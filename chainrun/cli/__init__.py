"""The ``chainrun`` command line.

Each subcommand is a thin layer over the store, the engine and the service.
Any ``ChainrunError`` becomes one line on stderr and its exit code (2 for bad
input); a traceback only ever means a bug.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

import click

from chainrun.cli.group import LOG_LEVELS, Group
from chainrun.cli.web import tensorboard, ui
from chainrun.constants import CONFIRM_ABOVE, DEFAULT_INTERVAL, VERSION
from chainrun.errors import ChainrunError, StoreUnavailable, TransportError, UsageError

if TYPE_CHECKING:
    from chainrun.model import Chain
    from chainrun.status import Shown
    from chainrun.store import DamagedChain, Store
    from chainrun.transport import Transport

# Each command imports what it uses: `--help` formats them all, and `status` should
# not pay for the service, the schedulers or the job file parser.


def _interval(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[float]:
    """``--interval``: seconds, or a duration, within the service's bounds.

    A bad value is one line (chainrun's own usage error, exit 2), not click's usage block."""
    if value is None:
        return None
    from chainrun.config import parse_interval

    try:
        return parse_interval(value)
    except ValueError as exc:
        raise UsageError(f"--interval {value}: {exc}") from None


def _watch(ctx: click.Context, param: click.Parameter, value: Optional[float]) -> Optional[float]:
    """``status --watch``: a refresh period from 0.1 s to 1 h (never nan or inf)."""
    if value is not None and not (math.isfinite(value) and 0.1 <= value <= 3600):
        raise UsageError(f"--watch {value}: must be 0.1 to 3600 seconds")
    return value


@click.group(cls=Group)
@click.version_option(VERSION, prog_name="chainrun", message="%(prog)s %(version)s")
@click.option(
    "--home",
    type=click.Path(file_okay=False),
    default=None,
    help="State directory (default $CHAINRUN_HOME or ~/.local/state/chainrun).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
    help="Log messages of this level and above.",
)
@click.option("--debug", is_flag=True, help="Show the full traceback of an unexpected error.")
@click.pass_context
def main(ctx: click.Context, home: Optional[str], log_level: str, debug: bool) -> None:
    """Keep long training runs alive across walltime-limited batch jobs.

    Exit codes: 0 done; 1 a chain that did not (or cannot) complete, or a
    cluster or state database that cannot be reached now; 2 bad input (a job
    file, option, chain or state directory), always one line on stderr;
    130 Ctrl-C.
    """
    from chainrun import logsetup
    from chainrun.home import default_home

    if home == "":  # click would make it ".": state in whatever directory this runs in
        raise UsageError("--home: an empty path; give the state directory, or leave --home out")
    # `run` prints the chain's events itself; its service logs only trouble. `cancel` says in
    # its own lines what its tick did; the tick's records go to the service's log file.
    quiet = ctx.invoked_subcommand == "run" and log_level == "info"
    logsetup.setup("warning" if quiet else log_level, console=ctx.invoked_subcommand != "cancel")
    ctx.obj = Path(home) if home else default_home()


@contextmanager
def _store(ctx: click.Context, readonly: bool = False) -> Iterator[Store]:
    """The state database; ``readonly`` for commands that only look: they write nothing,
    never wait long on a writer, and read a missing database as one without chains."""
    from chainrun.store import Store

    store = Store(ctx.obj, readonly=readonly)
    try:
        yield store
    finally:
        store.close()


@main.command()
@click.argument("jobfile_path", metavar="JOBFILE", type=click.Path(dir_okay=False))
@click.option(
    "--show-script",
    is_flag=True,
    help="Also print the first segment's batch script and the exact command that submits it.",
)
@click.pass_context
def check(ctx: click.Context, jobfile_path: str, show_script: bool) -> None:
    """Validate JOBFILE and print the plan: segments, walltimes, budget.

    Exits 0 for a job file that submit would take, 2 for a bad one, and 1 when
    another active chain trains into its checkpoint_dir.
    """
    from chainrun import check as checking
    from chainrun import jobfile, submission, sweep

    spec, unasked = checking.probe_nodes(jobfile.load(jobfile_path))
    chains = sweep.expand(spec)
    script, argv = checking.preflight(chains[0])
    with suppress(TransportError):  # a machine check cannot reach now: submit asks again
        jobfile.where_it_runs(spec)
    with _store(ctx, readonly=True) as store:
        notes = submission.meet_holds(store, chains)
    shared = submission.probe_shared(spec)[1] if spec.scheduler.hosts else ""
    for line in checking.summary(jobfile_path, spec, chains, shared):
        click.echo(line)
    for line in checking.warnings(spec) + notes + ([unasked] if unasked else []):
        click.echo(line, err=True)
    if show_script:
        click.echo(checking.script_text(spec, script, argv), nl=False)


_fresh = click.option(
    "--fresh",
    is_flag=True,
    help="Start over: first move checkpoint_dir aside to <dir>.old-<UTC time> (never deleted).",
)


@main.command()
@click.argument("jobfile_paths", metavar="JOBFILE...", nargs=-1, required=True)
@_fresh
@click.option("--yes", is_flag=True, help=f"Submit even more than {CONFIRM_ABOVE:,} chains at once.")
@click.pass_context
def submit(ctx: click.Context, jobfile_paths: tuple[str, ...], fresh: bool, yes: bool) -> None:
    """Submit the chains in the job files; prints one chain id per line.

    Each JOBFILE may also be a directory (its *.toml files) or a quoted glob
    pattern. A job file with a [sweep] makes one chain per configuration and
    repetition. All are checked first and stored together: a bad job file
    stores nothing. A chain still active from an earlier submission of the
    same job file is left as it is, and its id printed again; so is the
    chain that already completed a job file's checkpoint.

    Exits 0 when the chains are stored, 2 for a bad job file or option, and 1
    when they cannot be: a checkpoint is already complete and no chain here
    completed it (use --fresh to start over), another active chain trains
    into the same checkpoint_dir, or a cluster cannot be reached.
    """
    from chainrun import jobfile, submission
    from chainrun.lock import lock_for

    specs = [jobfile.load(path) for path in _job_files(jobfile_paths)]
    total = sum(len(spec.sweep) * spec.reps or 1 for spec in specs)
    if total > CONFIRM_ABOVE and not yes:
        raise UsageError(f"that is {total:,} chains; add --yes to submit them all")
    with _store(ctx) as store:
        submitted = submission.submit_all(store, specs, fresh=fresh)
    for chain_id, _, _ in submitted:
        click.echo(chain_id)
    if not lock_for(ctx.obj).held_elsewhere():
        from chainrun.systemd import start_advice

        click.echo(f"note: no chainrun service is running; {start_advice(ctx.obj)}", err=True)


def _job_files(args: Sequence[str]) -> list[str]:
    """The job files named: each a file, a directory (its *.toml, sorted) or a glob pattern."""
    found: list[str] = []
    for arg in args:
        if os.path.isdir(arg):
            inside = sorted(glob.glob(os.path.join(glob.escape(arg), "*.toml")))
            if not inside:
                raise UsageError(f"{arg}: a directory with no *.toml job files")
            found += inside
        elif any(c in arg for c in "*?[") and not os.path.exists(arg):
            matched = sorted(glob.glob(arg))
            if not matched:
                raise UsageError(f"{arg}: no job files match")
            found += matched
        else:
            found.append(arg)
    return list(dict.fromkeys(found))


@main.command()
@click.argument("jobfile_path", metavar="JOBFILE", type=click.Path(dir_okay=False))
@click.option(
    "--interval",
    default=None,
    callback=_interval,
    metavar="SECONDS",
    help="Seconds between ticks, 0.2 to 3600 (default: an eighth of the walltime, 1 to 10).",
)
@_fresh
@click.pass_context
def run(ctx: click.Context, jobfile_path: str, interval: Optional[float], fresh: bool) -> None:
    """Submit JOBFILE and supervise it here until the chain (or sweep) ends.

    Shows the chain's events, and its progress, ETA, segment and last line of
    output (refreshed in place on a terminal, a line per change otherwise). For
    a sweep: every chain's events, the sweep's bar and ETA, its chains by state
    with the best metric so far, and a line per running chain. If a service
    already runs, it does the work and this command only follows. Ctrl-C asks
    whether to stop watching (the chains go on) or to cancel the chain (the
    whole sweep).

    Exits 0 when the chain (every chain of the sweep) completes; 1 when one ends
    otherwise (failed, out of time, cancelled); 130 when you stop watching and
    the chains go on, as a shell reports a command stopped by Ctrl-C; 2 for a bad
    job file or option.
    """
    from chainrun import jobfile, submission, sweeprun
    from chainrun import run as running

    spec = jobfile.load(jobfile_path)
    with _store(ctx) as store:
        submitted = submission.submit_all(store, [spec], fresh=fresh)
        watch: running.Watch
        if spec.sweep:
            watch = sweeprun.SweepFollower(store, spec.name, [s.chain_id for s in submitted])
            click.echo(sweeprun.submitted_line(spec.name, [s.how for s in submitted]))
        else:
            ((chain_id, _, how),) = submitted
            watch = running.Follower(store, chain_id)
            said = {"submitted": "chain {} submitted", "running": "following chain {}, already running"}
            click.echo(said.get(how, "chain {} already completed").format(chain_id))
        step = interval or min(DEFAULT_INTERVAL, max(1.0, spec.walltime / 8))
        code = running.supervise(ctx.obj, watch, step)
    sys.exit(code)


@main.command()
@click.option(
    "--interval",
    default=None,
    callback=_interval,
    metavar="SECONDS",
    help=f"Seconds between ticks, 0.2 to 3600 (default: the config's interval, else {DEFAULT_INTERVAL:g}).",
)
@click.pass_context
def daemon(ctx: click.Context, interval: Optional[float]) -> None:
    """Run the service in the foreground (what the systemd unit starts).

    SIGHUP re-reads the service config and re-opens the log file; SIGTERM
    stops it, leaving queued jobs running.
    """
    from chainrun.service import Service

    Service(ctx.obj, interval=interval).run()


@main.command()
@click.argument("chain_ref", metavar="CHAIN")
@click.option("--yes", is_flag=True, help="Cancel a whole sweep without asking.")
@click.pass_context
def cancel(ctx: click.Context, chain_ref: str, yes: bool) -> None:
    """Cancel CHAIN (or every chain of the sweep CHAIN): its queued and running jobs are cancelled.

    One line per chain. A segment that was running keeps the time it ran and
    the progress it made. Without a service, the cancel is carried out here
    (its log records go to the service's log file, service.log).

    Exits 0 (also when it had already ended); 2 for an unknown CHAIN; 1 when
    CHAIN is damaged, the cluster cannot be reached, or a sweep's cancel was
    not confirmed.
    """
    from chainrun import cancel as cancelling
    from chainrun import logsetup
    from chainrun.text import duration

    with _store(ctx) as store:
        members = store.sweep(chain_ref)
        targets = members or [store.find(chain_ref)]
        going = [c for c in targets if not c.state.final]
        for chain in targets:
            if chain.state.final:
                click.echo(f"chain {chain.id} already {chain.state.value}")
        if not going:
            return
        if members and not yes:
            question = f"cancel the {len(going)} unfinished chains of sweep {chain_ref}?"
            if not sys.stdin.isatty() or not click.confirm(question, default=False, err=True):
                raise ChainrunError(f"not cancelled; to cancel sweep {chain_ref} without asking, add --yes")
        with suppress(OSError):  # a home it cannot write: the records go nowhere
            logsetup.open_file(ctx.obj)
        summary = cancelling.cancel(ctx.obj, store, going, wait=_saying_who_saves)
        if summary is None:
            for chain in going:
                click.echo(f"chain {chain.id}: cancel requested; the running service carries it out")
            return
        undone = False
        owed = store.owed_by_chain()
        for chain in (store.chain(c.id) for c in going):
            if chain.state.final:
                kept = f"budget used {duration(chain.used)}, {chain.progress.describe()}"
                click.echo(f"chain {chain.id} {chain.state.value}" + (f" ({kept})" if chain.used else ""))
                left = [job for job, _ in owed.get(chain.id, [])]
                if left:
                    click.echo(
                        f"chainrun: chain {chain.id}: job{'s' * (len(left) > 1)} {', '.join(left)} still "
                        "queued: the scheduler did not take the cancel (see `chainrun history`); the service "
                        "sends it again once the scheduler answers (none running: start `chainrun daemon`)",
                        err=True,
                    )
                continue
            why = summary.unreachable.get(chain.cluster_key) or next(
                (e for e in summary.errors if e.startswith(f"{chain.id}: ")), "its tick failed"
            )
            click.echo(f"chainrun: chain {chain.id}: cancel requested, not carried out: {why}", err=True)
            undone = True
        if undone:  # the cancel stays requested: the next tick of any service carries it out
            sys.exit(1)


def _saying_who_saves(chain: Chain) -> None:
    """The line a cancel prints while a running segment of ``chain`` saves before it ends."""
    from chainrun.decide.grace import grace_in_force
    from chainrun.fields import format_duration
    from chainrun.model import Phase

    running = next((s for s in chain.live if s.phase is Phase.RUNNING), None)
    if running is not None:
        grace = format_duration(grace_in_force(chain.spec, chain.segments).seconds)
        click.echo(f"chain {chain.id}: segment {running.n} has the signal to save and stop (up to {grace})")


@main.command()
@click.option(
    "--older-than",
    metavar="DURATION",
    help="Keep what chains that ended more recently ran (default: the config's gc_after, else 7d).",
)
@click.pass_context
def gc(ctx: click.Context, older_than: Optional[str]) -> None:
    """Remove the code snapshots of chains that ended long ago.

    Their refs (refs/chainrun/ID), each chain's working copy (WORKDIR/.chainrun/ID/code)
    and the unpacked code (WORKDIR/.chainrun/code/COMMIT), never what a chain that has
    not ended (or ended more recently) runs: a code directory shared with such a chain
    stays. What a copy still holds is first brought home to the workdir; a copy holding
    something that cannot be is named and kept. The service does this at start and
    once a day.
    Exits 0; 1 when something could not be removed (a host out of reach, a file kept).
    """
    import time

    from chainrun import gc as collection
    from chainrun.config import load_config
    from chainrun.fields import DURATION_HELP, parse_duration

    keep = load_config().gc_after or collection.DEFAULT_AFTER
    if older_than is not None:
        try:
            keep = parse_duration(older_than)
        except ValueError:
            raise UsageError(f"--older-than {older_than}: not {DURATION_HELP}") from None
    with _store(ctx) as store:
        done = collection.collect(store, time.time(), keep)
    for where in done.moved:
        click.echo(f"brought home {where}")
    for chain_id in done.refs:
        click.echo(f"removed ref refs/chainrun/{chain_id}")
    for where in done.code:
        click.echo(f"removed {where}")
    if not done.refs and not done.code:
        click.echo("nothing to remove")
    for problem in done.problems:
        click.echo(f"chainrun: {problem}", err=True)
    if done.problems:
        sys.exit(1)


@main.command()
@click.argument("chain_ref", metavar="[CHAIN]", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, every field.")
@click.option(
    "--all", "show_all", is_flag=True, help="Include ended chains (default: active, and ended today)."
)
@click.option("--verbose", "-v", is_flag=True, help="Every chain's reason and details, not only trouble.")
@click.option(
    "--hosts",
    "show_hosts",
    is_flag=True,
    help="The pools' machines instead: reachable since when, slots used, GPUs given out, chains there.",
)
@click.option(
    "--watch",
    "-w",
    type=float,
    callback=_watch,
    is_flag=False,
    flag_value=2.0,
    default=None,
    metavar="[SECONDS]",
    help="Refresh in place every SECONDS (default 2) until Ctrl-C, or until CHAIN ends.",
)
@click.pass_context
def status(
    ctx: click.Context,
    chain_ref: Optional[str],
    as_json: bool,
    show_all: bool,
    verbose: bool,
    show_hosts: bool,
    watch: Optional[float],
) -> None:
    """Show chains, one line each: state, progress, ETA, failures, segments, time.

    The table is as wide as the terminal, or 80 columns when the output is not
    a terminal; columns that do not fit are left out (--json has them all).
    Below it, a line for each chain that needs attention (failed, stuck,
    damaged, retrying a submission, held by the scheduler); --verbose shows
    every chain's reason and details. With CHAIN, its details (its jobs too),
    and for a failed chain the last lines of its failing segment's output. With
    a sweep's name, each metric compared over its configurations (mean and
    spread over repetitions, best first) and its chains named by their parameters.

    Exits 0; 2 for an unknown CHAIN or a bad option; 1 when CHAIN is damaged
    or the state database cannot be read.
    """
    from chainrun import status as view

    if show_hosts:
        _hosts(ctx, chain_ref, as_json)
        return
    if watch is not None and as_json:
        raise UsageError("--watch draws a table for people; for scripts, run `status --json` in a loop")
    tty = sys.stdout.isatty()

    group = [False]  # CHAIN named a sweep

    def draw(
        shown: Sequence[Shown], damaged: list[DamagedChain], owed: dict[str, list[tuple[str, float]]]
    ) -> str:
        # Measured at each frame: a terminal resized under --watch gets the new width.
        width = shutil.get_terminal_size((view.WIDTH, 24)).columns if tty else view.WIDTH
        if group[0]:  # a sweep: its metrics compared, its chains named by their parameters
            from chainrun import sweepstatus

            members = cast("Sequence[Chain]", shown)  # a sweep's chains are read in full
            label = sweepstatus.label(members, width, verbose)
            text = view.frame(ctx.obj, shown, time.time(), damaged, width=width, verbose=verbose, label=label)
            return f"{sweepstatus.summary(chain_ref or '', members, width, verbose)}\n{text}"
        one = chain_ref is not None
        # One chain asked for by name: all there is to know of it, its jobs included.
        return view.frame(
            ctx.obj, shown, time.time(), damaged, width=width, verbose=verbose or one, tails=one, owed=owed
        )

    with _store(ctx, readonly=True) as store:

        def chains() -> tuple[list[Chain], list[DamagedChain]]:
            """The chains to show (active, ended today, or --all), and apart the damaged ones
            among them (they need a person); chosen in SQL, older ended chains are never read."""
            if chain_ref is not None:
                members = store.sweep(chain_ref)
                group[0] = bool(members)
                return members or [store.find(chain_ref)], []
            return store.shown(None if show_all else time.time() - 86400)

        def table() -> tuple[Sequence[Shown], list[DamagedChain], dict[str, list[tuple[str, float]]]]:
            """The same for the table alone (no CHAIN, no --verbose): what it shows of each
            chain, read without decoding the chains (that was most of the time `status` took);
            with the details, the cancels each chain is owed."""
            if chain_ref is None and not verbose:
                return (*store.glance(None if show_all else time.time() - 86400), {})
            return (*chains(), store.owed_by_chain())

        if as_json:
            now = time.time()
            good, damaged = chains()
            owed = store.owed_by_chain()
            data = [view.to_json(c, now, owed.get(c.id, ())) for c in good]
            data += [view.damaged_json(d) for d in damaged]
            click.echo(json.dumps(data, indent=2))
            return
        if watch is None:
            click.echo(draw(*table()))
            return
        try:
            while True:
                try:
                    shown, damaged, owed = table()
                    frame = draw(shown, damaged, owed)
                except StoreUnavailable as exc:  # busy for a moment: say so, and look again
                    shown, frame = [], f"chainrun: {exc}"
                stamp = f"every {watch:g}s, {datetime.now():%H:%M:%S} (Ctrl-C to quit)"
                text = f"{stamp}\n\n{frame}"
                if tty:  # home, redraw each line clearing its tail, clear below: no flicker
                    text = "\x1b[H" + "".join(f"{line}\x1b[K\n" for line in text.splitlines()) + "\x1b[J"
                click.echo(text, nl=not tty)
                if chain_ref is not None and shown and all(c.state.final for c in shown):
                    return
                time.sleep(watch)
        except KeyboardInterrupt:
            return


def _hosts(ctx: click.Context, chain_ref: Optional[str], as_json: bool) -> None:
    """``status --hosts``: each pool host as the service's last tick found it."""
    from chainrun import poolstatus
    from chainrun import status as view

    if chain_ref is not None:
        raise UsageError("--hosts shows every pool's machines; give no CHAIN with it")
    with _store(ctx, readonly=True) as store:
        shown = poolstatus.hosts(ctx.obj, store.chains(active_only=True))
    if as_json:
        click.echo(json.dumps(shown, indent=2))
        return
    width = shutil.get_terminal_size((view.WIDTH, 24)).columns if sys.stdout.isatty() else view.WIDTH
    for line in [view.service_line(ctx.obj, time.time()), "", *poolstatus.table(shown, time.time(), width)]:
        click.echo(line)


@main.command()
@click.argument("chain_ref", metavar="CHAIN")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: events, segments, totals.")
@click.pass_context
def history(ctx: click.Context, chain_ref: str, as_json: bool) -> None:
    """Show CHAIN's events: every decision with its reason; then each segment's queue wait,
    time training, time saving after the signal, gap to the next segment's start, and the
    chain's training time after it; then what the allocation bought.

    Exits 0; 2 for an unknown CHAIN.
    """
    from chainrun import history as shown

    now = time.time()
    with _store(ctx, readonly=True) as store:
        # By id alone: the events of a damaged chain can still be read (its segments cannot).
        chain_id = store.resolve(chain_ref)
        # In the order things happened: an end found out late is stamped when it happened.
        events = sorted(store.events(chain_id), key=lambda e: e.at)
        chain: Optional[Chain] = None
        with suppress(ChainrunError):
            chain = store.chain(chain_id)
    if as_json:
        click.echo(json.dumps(shown.to_json(chain_id, events, chain, now), indent=2))
        return
    lines = shown.event_lines(events)
    if chain is not None:
        lines += ["", *shown.segment_lines(chain, now, events)]
    for line in lines:
        click.echo(line)


@main.command()
@click.argument("chain_ref", metavar="CHAIN")
@click.option(
    "--segment", "-n", type=click.IntRange(min=1), default=None, help="Segment number (default: all)."
)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the chain ends.")
@click.pass_context
def logs(ctx: click.Context, chain_ref: str, segment: Optional[int], follow: bool) -> None:
    """Print the output of CHAIN's segments.

    Exits 0; 2 for an unknown CHAIN or segment, or a bad option; 1 when the
    cluster cannot be reached.
    """
    from chainrun.schedulers.segment import SegmentJob
    from chainrun.transport import transport_for

    with _store(ctx, readonly=True) as store:
        chain = store.find(chain_ref)
        first = chain.spec.places[0].name if chain.spec.places else None
        transports: dict[Optional[str], Transport] = {}
        offsets: dict[int, int] = {}
        while True:
            chain = store.chain(chain.id)
            shown = [s for s in chain.segments if segment is None or s.n == segment]
            if segment is not None and not shown:
                have = f"1 to {chain.next_n - 1}" if chain.segments else "none yet"
                raise UsageError(f"chain {chain.id} has no segment {segment} (it has {have})")
            for seg in shown:
                # Read where it ran: its place's workdir (a chain with several), its pool host.
                there = chain.spec.at(seg.place or first)
                host = seg.host or there.scheduler.first_host
                if host not in transports:
                    transports[host] = transport_for(host)
                path = SegmentJob(chain.id, seg.n, there, 0).log_path
                data = transports[host].read_file(path) or b""
                start = offsets.get(seg.n, 0)
                if start == 0 and data and len(shown) > 1:
                    click.echo(f"==> segment {seg.n}: {path} <==")
                if len(data) > start:
                    click.echo(data[start:].decode(errors="replace"), nl=False)
                offsets[seg.n] = len(data)
            if not follow or chain.state.final:
                break
            time.sleep(1.0)


@main.group()
def service() -> None:
    """Run chainrun as a systemd user service: install, uninstall, status."""


@service.command("install")
@click.option("--now", is_flag=True, help="Also start the service.")
@click.pass_context
def service_install(ctx: click.Context, now: bool) -> None:
    """Write the user unit for this chainrun and its state directory, and enable it.

    The unit carries CHAINRUN_HOME (this command's state directory) and what
    else chainrun and the schedulers read from this shell's environment.
    Exits 0; 1 with --now where no systemd user manager answers: nothing was
    started, and the output says how to start the service by hand.
    """
    from chainrun import systemd as unit

    lines, answered = unit.install(ctx.obj, now=now)
    for line in lines:
        click.echo(line)
    if now and not answered:
        raise ChainrunError("nothing was started: no systemd user manager answers here (see above)")


@service.command("uninstall")
def service_uninstall() -> None:
    """Stop and disable the service and remove its unit."""
    from chainrun import systemd as unit

    for line in unit.uninstall():
        click.echo(line)


@service.command("status")
@click.pass_context
def service_status(ctx: click.Context) -> None:
    """Show the unit, what systemd says of it, lingering, the config and the process."""
    from chainrun import status as view
    from chainrun import systemd as unit

    for line in unit.status(ctx.obj):
        click.echo(line)
    click.echo(view.service_line(ctx.obj, time.time()))


main.add_command(ui)
main.add_command(tensorboard)
