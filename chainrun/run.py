"""``chainrun run``'s view of the chain it supervises, its Ctrl-C prompt and its last word.

What is watched is a ``Watch``: one chain (``Follower``, below) or a sweep's chains
(``sweeprun``); ``View`` draws the ``Frame`` either makes, and ``supervise`` drives both.

The chain's events print as lines. Under them a progress area shows how far
the chain is (epochs of the target, or time used of the budget), the ETA,
the current segment and its job's state, and the last line of the training
output, read from the segment's log on the host it runs on (only its
end, and only when its size changed). On a terminal the area is redrawn in
place by ``rich``, imported only then; elsewhere each change of progress is
one plain line (``plain_line``), never a redraw. The first Ctrl-C on a
terminal asks whether to stop watching (the chain goes on) or to cancel the
chain; a second Ctrl-C, or no terminal, stops watching. A failed chain ends
with the last lines of its failing segment's output (as the wrapper recorded
them) and the ``chainrun logs`` command that shows all of it. While the chain's
cluster cannot be polled (an SSH drop, a scheduler that does not answer) the
chain waits, charged nothing: a line says so once (``connection lost, retrying
in N s``), the area counts down to the next try, and a line says when the
connection is back. (Only when this process is the service: a service running
elsewhere does its own retrying.) The run directory's markers are looked at every
second or so (``MARKER_STEP``), so that a segment's start and end are told then, not
at the next tick: while a service elsewhere drives the chain, from the markers (its
own line on how a segment ended follows when it has judged it); while this process
is the service, a marker it has not seen brings its next tick forward.
"""

from __future__ import annotations

import math
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import click

from chainrun.decide.startup import slow_start
from chainrun.engine import TickSummary
from chainrun.errors import ChainrunError, TransportError
from chainrun.lock import lock_for
from chainrun.markers import MarkerReader
from chainrun.model import Chain, ChainState, Phase, Segment
from chainrun.schedulers.segment import SegmentJob
from chainrun.service import Service
from chainrun.status import budget_used, eta, never_clears
from chainrun.store import Store
from chainrun.text import clip, duration, visible
from chainrun.transport import Transport, transport_for

EXIT_COMPLETED = 0
EXIT_NOT_COMPLETED = 1  # failed, exhausted or cancelled
# Stopped watching, the chain goes on: it has not completed, and 128 + SIGINT is
# what a shell reports of a command stopped by Ctrl-C.
EXIT_STOPPED_WATCHING = 130
PROMPT = "Stop watching (the chain goes on) or cancel the chain? [w/c] "
START_ADVICE = "it advances only while a service runs: `chainrun service install --now`, or `chainrun daemon`"
TAIL_LINES = 5  # of a failing segment's output, under the final line
OUTPUT_BYTES = 16384  # of a log's end, read for its last lines
OUTPUT_WIDTH = 160  # characters of the output line in plain mode
REFRESH_PER_SECOND = 2
PROMPT_STEP = 0.2  # seconds between looks for a Ctrl-C while the question waits
BAR_WIDTH = 30
MARKER_STEP = 1.0  # seconds between looks at the markers
# Seconds after which a marker the store has still not recorded is news again: a tick
# brought forward may have come before the scheduler's listing showed the job's end.
NEWS_AGAIN = 5.0


# -- what is shown: pure functions of a chain, its output and now -------------------


@dataclass(frozen=True)
class Frame:
    """The progress area at one moment: a bar (``done`` of ``total``) with ``head`` beside it,
    ``lines`` under it, the last line of output; off a terminal, the one ``plain`` line,
    printed when ``key`` changed."""

    done: float
    total: float
    head: str
    lines: tuple[str, ...]
    output: str
    plain: str
    key: tuple[object, ...]
    final: bool


def chain_frame(chain: Chain, output: str, now: float) -> Frame:
    """One chain's frame: its progress and ETA, its segment (and since when it runs), its output."""
    done, total, words = measure(chain, now)
    seg = current(chain)
    since = ""
    if seg is not None and seg.phase is Phase.RUNNING and seg.started_at is not None:
        since = f", {duration(now - seg.started_at)}"
    return Frame(
        done,
        total,
        f"{words}  {eta_text(chain, now)}",
        (f"{segment_text(chain)}{since}", *warning(chain)),
        output,
        plain_line(chain, output, now),
        plain_key(chain, output),
        chain.state.final,
    )


def current(chain: Chain) -> Optional[Segment]:
    """The segment to show: the running one, else the next one to run, else the last."""
    live = chain.live
    running = [s for s in live if s.phase is Phase.RUNNING]
    if running:
        return running[0]
    if live:
        return min(live, key=lambda s: s.n)
    return chain.segments[-1] if chain.segments else None


def job_state(seg: Optional[Segment]) -> str:
    """The segment's job in a few words: running, queued (with the scheduler's reason, and what
    to change when that reason will not clear by itself), retrying."""
    if seg is None:
        return "not submitted yet"
    job = f" as job {seg.job_id}" if seg.job_id else ""
    reason = f" ({seg.reason})" if seg.reason else ""
    if seg.phase is Phase.RUNNING:
        return f"running{job}"
    if seg.phase is Phase.PENDING:
        return f"queued{job}{reason}{never_clears(seg)}"
    if seg.phase is Phase.SUBMITTING:
        return f"retrying the submission{reason}" if seg.retry_at is not None else "submitting"
    return f"ended: {seg.reason}" if seg.reason else "ended"


def measure(chain: Chain, now: float) -> tuple[float, float, str]:
    """How far the chain is: (done, total, in words), in epochs of the target, else in
    budget used of ``total_time``."""
    target = chain.spec.target_epoch
    if target:
        epoch = chain.latest.epoch
        done = min(epoch or 0, target)
        words = f"epoch {'-' if epoch is None else epoch}/{target}"
        return done, target, f"{words} {100 * done // target}%"
    used = min(budget_used(chain, now), float(chain.spec.total_time))
    total = chain.spec.total_time
    return used, total, f"budget used {duration(used)}/{duration(total)} {int(100 * used // total)}%"


def eta_text(chain: Chain, now: float) -> str:
    """``ETA 5m``, or nothing when it is not known (no target, no epoch rate yet)."""
    left = eta(chain, now)
    return "" if left is None else f"ETA {duration(left)}"


def segment_text(chain: Chain) -> str:
    """``segment 2 of 18 running as job 4711``."""
    seg = current(chain)
    n = f"{seg.n} of {chain.max_segments} " if seg is not None else ""
    return f"segment {n}{job_state(seg)}"


def plain_line(chain: Chain, output: str, now: float) -> str:
    """The progress line printed when stdout is not a terminal."""
    head = measure(chain, now)[2]
    left = eta_text(chain, now)
    parts = [f"{head}, {left}" if left else head, segment_text(chain), *warning(chain)]
    if output:
        parts.append(f"output: {clip(output, OUTPUT_WIDTH, '...')}")
    return "; ".join(parts)


def plain_key(chain: Chain, output: str) -> tuple[object, ...]:
    """What a new plain line is printed for: a new epoch, segment, job state or output line.
    Time alone (the ETA, time used) changes nothing: no line per tick."""
    seg = current(chain)
    return (chain.latest.epoch, None if seg is None else seg.n, job_state(seg), output, warning(chain))


def warning(chain: Chain) -> tuple[str, ...]:
    """``warning: start-up takes most of each segment ...`` while that is so (decide.startup)."""
    slow = "" if chain.state.final else slow_start(chain.segments)
    return (f"warning: {slow}",) if slow else ()


def final_lines(chain: Chain) -> list[str]:
    """The last word on an ended chain: its state and reason; for a failed one, the last
    lines of output of the segment that failed it, and where to see all of it."""
    lines = [f"chain {chain.id} {chain.state.value}: {chain.reason}"]
    slow = "" if chain.state is ChainState.COMPLETED else slow_start(chain.segments)
    lines += [f"warning: {slow}"] if slow else []
    seg = chain.failing
    if chain.state is ChainState.FAILED and seg is not None:
        lines += [f"    {visible(line)}" for line in seg.tail[-TAIL_LINES:]]
        lines.append(f"see all of it: chainrun logs {chain.id} -n {seg.n}")
    return lines


def trouble_text(exc: ChainrunError, retry_in: float) -> str:
    """Why the chain waits, and when the next try is: ``connection lost, retrying in 5 s``."""
    what = "connection lost" if isinstance(exc, TransportError) else "the scheduler did not answer"
    return f"{what}, retrying in {math.ceil(retry_in)} s"


def going_on_lines(chain: Chain, service_elsewhere: bool) -> list[str]:
    """What stopping watching leaves: the chain goes on, and how to look again."""
    lines = [f"chain {chain.id} goes on; see it with: chainrun status {chain.id}"]
    return lines if service_elsewhere else [*lines, START_ADVICE]


def last_lines(text: str, n: int) -> list[str]:
    """The last ``n`` non-blank lines of output, each as a terminal shows it."""
    shown = [visible(raw) for raw in text.split("\n")]
    return [line for line in shown if line.strip()][-n:]


def stamp(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


# -- reading: the store and the segment's log --------------------------------------------


def read_tail(transport: Transport, path: str, size: int) -> str:
    """The last ``OUTPUT_BYTES`` of the file at ``path`` (``size`` bytes long): a small
    file read whole, a larger one cut there by ``tail`` (its first, partial line dropped)."""
    if size <= OUTPUT_BYTES:
        return (transport.read_file(path, OUTPUT_BYTES) or b"").decode(errors="replace")
    result = transport.run(["tail", "-c", str(OUTPUT_BYTES), "--", path], timeout=30)
    return result.stdout.split("\n", 1)[-1] if result.ok else ""


class Watch(Protocol):
    """What ``supervise`` follows: one chain (``Follower``) or a sweep's chains."""

    noun: str  # what is watched, in a word: "chain", "sweep"
    prompt: str  # the first Ctrl-C's question

    def look(self, markers: bool) -> tuple[list[str], Callable[[float], Frame], list[tuple[str, str]]]:
        """The event lines not returned before, what the area shows (at a given time), and
        the clusters (``cluster_key``) of the chains watched."""

    def news(self) -> bool:
        """Whether the markers show a segment's start or end the store has not recorded yet."""

    def ended(self) -> bool: ...

    def request_cancel(self) -> None: ...

    def last_word(self, service_elsewhere: bool) -> tuple[list[str], int]:
        """The lines after watching and the exit code: the end, or what goes on."""


class Follower:
    """One chain as the store and its log have it: new events, the chain, the output line.

    Used from the service's tick thread and from the main thread (a cancel), one
    at a time. The log is read only when its size or mtime changed; a log that
    cannot be read (a dropped connection) keeps the line shown before.
    """

    noun = "chain"
    prompt = PROMPT

    def __init__(
        self,
        store: Store,
        chain_id: str,
        transports: Callable[[Optional[str]], Transport] = transport_for,
    ) -> None:
        self.store = store
        self.chain_id = chain_id
        self.transports = transports
        self._lock = threading.Lock()
        self._seen = 0  # the last event id printed
        self._log: tuple[Optional[str], str, int, float] = (None, "", -1, 0.0)  # host, path, size, mtime read
        self._output = ""
        self.markers = MarkerReader()
        self._told: set[tuple[int, str]] = set()  # (segment, "start" or "end") told from its marker
        self._news: dict[tuple[int, str], float] = {}  # the same, reported by ``news``, and when

    def poll(self, markers: bool = False) -> tuple[list[str], Chain, str]:
        """The event lines not returned before, the chain, and the last line of its output;
        with ``markers``, also the starts and ends the markers show before the store does."""
        with self._lock:
            events = self.store.events(self.chain_id, self._seen)
            if events:
                self._seen = events[-1].id
            # A start told from its marker already: the service's own word on it would repeat it.
            events = [e for e in events if not (e.kind == "running" and (e.segment, "start") in self._told)]
            chain = self.store.chain(self.chain_id)
            seg = current(chain)
            if seg is not None and seg.phase in (Phase.RUNNING, Phase.ENDED):
                # A pool's chain is read on the host its segment was placed on, which may
                # not be the one it had (or lacked) when watching began.
                host = seg.host or chain.spec.scheduler.first_host or None
                self._read_output(host, SegmentJob(chain.id, seg.n, chain.spec, 0).log_path)
            lines = [f"{stamp(ev.at)}  {ev.message}" for ev in events]
            for key, at, text in self._ahead(chain) if markers else []:
                if key not in self._told:
                    self._told.add(key)
                    lines.append(f"{stamp(at)}  {text}")
            return lines, chain, self._output

    def look(self, markers: bool) -> tuple[list[str], Callable[[float], Frame], list[tuple[str, str]]]:
        lines, chain, output = self.poll(markers)
        return lines, lambda now: chain_frame(chain, output, now), [chain.cluster_key]

    def last_word(self, service_elsewhere: bool) -> tuple[list[str], int]:
        final = self.store.chain(self.chain_id)
        if not final.state.final:
            return going_on_lines(final, service_elsewhere), EXIT_STOPPED_WATCHING
        code = EXIT_COMPLETED if final.state is ChainState.COMPLETED else EXIT_NOT_COMPLETED
        return final_lines(final), code

    def news(self) -> bool:
        """Whether the markers show a start or an end the store has not recorded yet, not
        reported in the last ``NEWS_AGAIN`` seconds."""
        with self._lock:
            now = time.monotonic()
            ahead = [key for key, _, _ in self._ahead(self.store.chain(self.chain_id))]
            new = [key for key in ahead if now - self._news.get(key, -math.inf) >= NEWS_AGAIN]
            self._news.update(dict.fromkeys(new, now))
            return bool(new)

    def _ahead(self, chain: Chain) -> list[tuple[tuple[int, str], float, str]]:
        """Each start and end of a segment the store has not recorded yet, as the wrapper's
        markers tell it: (segment, "start" or "end"), its time, and the line that tells it."""
        told = []
        for seg in chain.segments:
            if not seg.phase.live:
                self.markers.forget(chain.id, seg.n)
                continue
            if seg.job_id is None:
                continue
            try:
                transport = self.transports(seg.host or chain.spec.scheduler.first_host or None)
                start = None if seg.phase is Phase.RUNNING else self.markers.start(transport, chain, seg.n)
                end = self.markers.end(transport, chain, seg.n)
            except TransportError:
                continue
            if start is not None:
                # The words of the service's own line on it, which then is not repeated.
                told.append(((seg.n, "start"), start.at or time.time(), f"segment {seg.n} is running"))
            if end is not None:
                told.append(
                    ((seg.n, "end"), end.at or time.time(), f"segment {seg.n} stopped: {end.describe()}")
                )
        return told

    def ended(self) -> bool:
        with self._lock:
            return self.store.chain(self.chain_id).state.final

    def request_cancel(self) -> None:
        with self._lock:
            self.store.request_cancel(self.chain_id, time.time())

    def _read_output(self, host: Optional[str], path: str) -> None:
        try:
            transport = self.transports(host)
            info = transport.stat(path)
            if info is None or not info.is_file or (host, path, info.size, info.mtime) == self._log:
                return
            lines = last_lines(read_tail(transport, path, info.size), 1)
        except TransportError:
            return
        self._log = (host, path, info.size, info.mtime)
        if lines:  # a new segment's empty log keeps the line its predecessor left
            self._output = lines[-1]


# -- showing -------------------------------------------------------------------------


class View:
    """Event lines and the progress area: rich's live display on a terminal, plain lines
    elsewhere. While paused (a prompt is up) event lines are held, and shown on resume."""

    def __init__(self, tty: bool) -> None:
        self._lock = threading.RLock()
        self._paused = False
        self._held: list[str] = []
        self._draw: Optional[Callable[[float], Frame]] = None
        self._key: Optional[tuple[object, ...]] = None
        # While the cluster cannot be polled: why, since when, and when the next try is.
        self._trouble: Optional[tuple[ChainrunError, float, float]] = None
        self._live: Any = None
        self._console: Any = None
        if tty:
            from rich.console import Console
            from rich.live import Live

            self._console = Console(highlight=False, markup=False, emoji=False)
            self._live = Live(
                console=self._console,
                get_renderable=self._area,
                refresh_per_second=REFRESH_PER_SECOND,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()

    def event(self, line: str) -> None:
        with self._lock:
            if self._paused:
                self._held.append(line)
            else:
                self._print(line)

    def show(self, chain: Chain, output: str, now: float) -> None:
        """The chain as it is now; in plain mode a line only when its progress changed."""
        self.show_frame(lambda at: chain_frame(chain, output, at), now)

    def show_frame(self, draw: Callable[[float], Frame], now: float) -> None:
        """What is watched, as ``draw`` makes it at any time (the area redraws it as time
        passes); in plain mode a line only when its key changed."""
        with self._lock:
            self._draw = draw
            if self._live is not None or self._paused:
                return
            frame = draw(now)
            if not frame.final and frame.key != self._key:
                self._key = frame.key
                click.echo(f"{stamp(now)}  {frame.plain}")

    def trouble(self, exc: Optional[ChainrunError], retry_in: float, now: float) -> None:
        """The cluster could not be polled (``exc``; the next try in ``retry_in`` s), or
        could again (None). A line when that changes; the area counts down meanwhile."""
        with self._lock:
            before = self._trouble
            if exc is None:
                self._trouble = None
                if before is not None:
                    self.event(f"{stamp(now)}  connection back after {duration(now - before[1])}; going on")
                return
            self._trouble = (exc, now if before is None else before[1], now + retry_in)
            if before is None:
                self.event(f"{stamp(now)}  {trouble_text(exc, retry_in)}: {exc}")

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            if self._live is not None:
                self._live.stop()

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            for line in self._held:
                self._print(line)
            self._held.clear()
            if self._live is not None:
                self._live.start()

    def close(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def _print(self, line: str) -> None:
        if self._live is not None:
            self._console.print(line, soft_wrap=True)
        else:
            click.echo(line)

    def _area(self) -> Any:
        """The progress area, drawn by rich's refresh thread from the last chain shown."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        draw = self._draw
        if draw is None:
            return Text("waiting for the first tick ...", style="dim")
        now = time.time()
        frame = draw(now)
        top = Table.grid(padding=(0, 1))
        top.add_row(ProgressBar(total=frame.total, completed=frame.done, width=BAR_WIDTH), Text(frame.head))
        lines: list[Any] = [top, *(Text(line, no_wrap=True, overflow="ellipsis") for line in frame.lines)]
        trouble = self._trouble
        if trouble is not None:
            lines.append(Text(trouble_text(trouble[0], max(0.0, trouble[2] - now)), style="yellow"))
        if frame.output:
            lines.append(Text(f"> {frame.output}", style="dim", no_wrap=True, overflow="ellipsis"))
        return Group(*lines)


# -- Ctrl-C --------------------------------------------------------------------------


def ask(prompt: str = PROMPT) -> str:
    """The first Ctrl-C's question, in the main thread: ``c`` (cancel) or ``w``
    (stop watching). ``w`` as well for Enter, end of input, a second Ctrl-C, and a
    stdin that is not a terminal (then nothing is asked)."""
    if not sys.stdin.isatty():
        return "w"
    # Ctrl-C at the prompt must end the read: Python's own handler, for the prompt only.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        click.echo("", err=True)  # the terminal's ^C has no newline of its own
        while True:
            click.echo(prompt, nl=False, err=True)
            answer = _read_line()
            word = answer.strip().lower()
            if not answer or word in ("", "w", "watch"):
                return "w"
            if word in ("c", "cancel"):
                return "c"
    except KeyboardInterrupt:
        click.echo("", err=True)
        return "w"
    finally:
        signal.signal(signal.SIGINT, previous)


def _read_line() -> str:
    """A line typed on stdin (empty at its end). The kernel may hand a Ctrl-C to any of this
    process's threads, and then no read in the main thread is interrupted: wait in short
    steps, so that Python raises KeyboardInterrupt here between them."""
    fd = sys.stdin.fileno()
    while not select.select([fd], [], [], PROMPT_STEP)[0]:
        pass
    return os.read(fd, 4096).decode(errors="replace")


# -- the whole ----------------------------------------------------------------------


def supervise(home: Path, watch: Watch, interval: float) -> int:
    """Follow ``watch`` (a chain, or a sweep's chains) until it ends or the user stops
    watching; the exit code.

    With no service running for ``home``, this process is the service (its ticks
    refresh the view) until the chains end; with one running elsewhere, it only
    follows, every ``interval`` seconds.
    """
    # A terminal that cannot move its cursor (TERM=dumb, as in an editor's shell) gets plain lines.
    view = View(tty=sys.stdout.isatty() and os.environ.get("TERM") not in ("dumb", "unknown"))
    elsewhere = lock_for(home).held_elsewhere()

    def refresh(summary: Optional[TickSummary] = None, markers: bool = False) -> None:
        lines, draw, clusters = watch.look(markers)
        for line in lines:
            view.event(line)
        now = time.time()
        if summary is not None:
            # The service ticks again after the interval, or sooner when the engine asks.
            retry_in = min(interval, summary.next_in if summary.next_in is not None else interval)
            trouble = (summary.unreachable.get(key) for key in clusters)
            view.trouble(next((exc for exc in trouble if exc is not None), None), retry_in, now)
        view.show_frame(draw, now)

    def interrupted() -> bool:
        """Ctrl-C: True to stop watching; a cancel is requested and watching goes on."""
        view.pause()
        try:
            answer = ask(watch.prompt)
            if answer == "c":  # its event says so; the next tick carries it out
                watch.request_cancel()
        finally:
            view.resume()
        return answer != "c"

    try:
        if elsewhere:
            view.event(f"a chainrun service is running; following the {watch.noun}")
            while True:
                try:
                    refresh(markers=True)  # the service elsewhere tells of a segment only as it ticks
                    if watch.ended():
                        break
                    time.sleep(min(interval, MARKER_STEP))
                except KeyboardInterrupt:
                    if interrupted():
                        break
        else:
            service = Service(
                home, interval=interval, on_tick=refresh, stop_when=watch.ended, on_interrupt=interrupted
            )
            stop = threading.Event()

            def look() -> None:
                """A start or an end the markers show first brings the next tick forward."""
                while not stop.wait(MARKER_STEP):
                    try:
                        if watch.news():
                            service.tick_now()
                    except ChainrunError:  # the database busy, say: the next look, or the tick, sees it
                        pass

            watcher = threading.Thread(target=look, name="markers", daemon=True)
            watcher.start()
            try:
                service.run()
            finally:
                stop.set()
                watcher.join()
            refresh()
    finally:
        view.close()
    lines, code = watch.last_word(lock_for(home).held_elsewhere())
    for line in lines:
        click.echo(line)
    return code
