"""``python -m chainrun``: the same as the ``chainrun`` command."""

from chainrun.cli import main

main(prog_name="chainrun")
