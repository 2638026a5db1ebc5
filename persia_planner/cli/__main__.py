"""``python -m persia_planner.cli``: the ``persia`` command."""

from persia_planner.cli.commands import main

main()
