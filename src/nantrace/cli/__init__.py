"""The ``nantrace`` command line: one module per subcommand."""
