"""CLI subcommands: ``add_arguments(parser)`` + ``run(args)``; heavy imports inside ``run``."""
