"""The ``veil`` command: one module per subcommand, each a parser plus a plain function."""
