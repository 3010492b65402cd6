"""The frame of the ``chainrun`` command line: click's group, with chainrun's exits.

Every failure is one line on stderr and an exit code (``Group`` says which); a
traceback only ever means a bug, and only ``--debug`` shows it.
"""

from __future__ import annotations

import errno
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

import click

from chainrun.errors import ChainrunError

LOG_LEVELS = ("debug", "info", "warning", "error")
MESSAGE_LIMIT = 500  # characters of a usage or internal error's message: one readable line
EXIT_INTERNAL = 1  # an unexpected exception: a bug in chainrun, or a failure it does not know yet
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command killed by Ctrl-C
# click >= 8.2 raises it for a group called without a command (older ones show the help themselves).
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _one_line(text: str) -> str:
    """A message as one readable line (``text`` is imported only when there is one to show)."""
    from chainrun.text import one_line

    return one_line(text, MESSAGE_LIMIT)


def _fail(message: str, code: int) -> NoReturn:
    from chainrun.text import printable

    click.echo(f"chainrun: {printable(message)}", err=True)
    sys.exit(code)


def _interrupted() -> NoReturn:
    # On a terminal the ^C echo has no newline: start ours on a line of its own.
    lead = "\n" if sys.stderr.isatty() else ""
    click.echo(f"{lead}chainrun: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def _internal(exc: BaseException, debug: bool) -> NoReturn:
    """An exception nothing expected: its traceback with ``--debug``, else one line."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()
        sys.exit(EXIT_INTERNAL)
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    message = _one_line(str(exc)) or "(no message)"
    _fail(f"internal error: {name}: {message} (run with --debug for the traceback)", EXIT_INTERNAL)


def _usage_message(exc: click.UsageError) -> str:
    """click's usage error as chainrun's one line: its message and where the help is."""
    message = _one_line(exc.format_message()).rstrip(".")
    if len(message) > 1 and message[0].isupper() and message[1].islower():
        message = message[0].lower() + message[1:]  # "No such option" -> "no such option"
    command = exc.ctx.command_path if exc.ctx is not None else "chainrun"
    return f"{message} (see `{command} --help`)"


class Group(click.Group):
    """Every failure is one line on stderr, never a traceback (unless ``--debug``).

    Exit codes:

    - 0: done; ``--help`` included.
    - a ``ChainrunError``: its message and its ``exit_code``: 2 for bad input (a
      job file, a chain or segment that is not there, a state directory that cannot
      be used), 1 otherwise (a checkpoint already complete, a cluster or database
      that cannot be reached now).
    - 2: a usage error click finds (unknown option or command, missing argument, a
      value of the wrong type, out of range or not among the choices), as
      ``chainrun: <message> (see `chainrun COMMAND --help`)``.
    - 1: any other exception, which is a bug: ``chainrun: internal error: <type>:
      <message> (run with --debug for the traceback)``. Exit 1 and not sysexits'
      70, because scripts and the systemd unit treat every non-zero, non-2 exit as
      "it failed" and 1 is what Python's own traceback exit was.
    - 130: Ctrl-C (``KeyboardInterrupt``): ``chainrun: interrupted``.

    ``chainrun --debug COMMAND`` prints the full traceback of an unexpected
    exception instead of its line. Commands may still ``sys.exit`` with their
    own codes (``run`` exits 1 when the chain did not complete).
    """

    def main(
        self,
        args: Optional[Sequence[str]] = None,
        prog_name: Optional[str] = None,
        complete_var: Optional[str] = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:  # the caller handles click's exceptions itself
            return super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(
                argv,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except _NO_ARGS_IS_HELP as exc:  # `chainrun` or `chainrun service` alone: the help, exit 2
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(_usage_message(exc), exc.exit_code)
        except click.ClickException as exc:
            _fail(_one_line(exc.format_message()), exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            _interrupted()
        except ChainrunError as exc:
            _fail(str(exc), exc.exit_code)
        except Exception as exc:
            # Outside invoke() (parsing the group's own options, closing the
            # context) --debug has not been parsed, or not by click: look for it.
            _internal(exc, "--debug" in argv)
        # Without standalone mode, an Exit (as from --help) comes back as its code.
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ChainrunError as exc:
            _fail(str(exc), exc.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # main() shows these
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise  # `chainrun history X | head`: click quiets the closed pipe
            _internal(exc, bool(ctx.params.get("debug")))
        except KeyboardInterrupt:
            _interrupted()
        except Exception as exc:
            _internal(exc, bool(ctx.params.get("debug")))
