. "$KV_CLI_LIB"
kvserve-once --help
