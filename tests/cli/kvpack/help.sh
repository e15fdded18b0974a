kvpack --help
