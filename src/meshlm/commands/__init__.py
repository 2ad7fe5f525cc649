"""One module per CLI subcommand (see meshlm.cli.COMMANDS)."""
