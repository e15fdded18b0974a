kvbake --help
