"""One module per `geotrain` subcommand (`<name>_cmd.py`), listed in `geotrain.cli.COMMANDS`."""
