"""One module per Make target; each has add_arguments(parser) and run(args)."""
