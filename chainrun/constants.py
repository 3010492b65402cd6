"""Numbers the command line shows in its help (its version too), in a module that imports nothing.

``chainrun --help`` formats every subcommand's help, so the defaults it quotes
live here rather than in the modules that use them (the service, sweeps),
which would otherwise be imported by every command just to print a number.
"""

VERSION = "0.1.0"  # chainrun's own (``chainrun.__version__``)
DEFAULT_INTERVAL = 10.0  # seconds between the service's ticks when neither config nor option says
CONFIRM_ABOVE = 10_000  # `submit` asks for --yes beyond this many chains at once
