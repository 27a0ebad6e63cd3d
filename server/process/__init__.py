"""The server process: ``tokembed serve``'s command line, its settings and their flags, the
worker processes, and the freed heap handed back to the OS."""
