"""The handlers of the ``mdtrain`` commands, one module per command.

``mdtrain.cli`` parses the command line and calls a handler with the parsed arguments; the
handler reads them, calls the library and prints, and returns the exit code. Only ``cli`` and
these modules know about the command line, so the library can be used without it. Nothing is
imported here: each command imports only what it needs (``neighbor-stat`` and ``check`` start
without torch).
"""
