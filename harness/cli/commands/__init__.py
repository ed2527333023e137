"""One module per `dsv4-drift` verb: each has `add_parser(subparsers)` and the function the verb runs."""
