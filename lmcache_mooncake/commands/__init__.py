"""The command line's subcommands (each: ``add_parser`` and ``run``), apart from store, warmup and make-model."""
