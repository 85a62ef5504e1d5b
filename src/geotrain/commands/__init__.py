"""One module per `geotrain` subcommand, discovered by `geotrain.cli`."""
