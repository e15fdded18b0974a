. "$KV_CLI_LIB"
kvindex --help
