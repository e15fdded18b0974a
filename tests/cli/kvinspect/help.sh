kvinspect --help
