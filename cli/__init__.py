"""The ``tokembed`` command: one entry point, a subcommand per room."""
