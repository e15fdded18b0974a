# A closed standard input is an error with the system's reason, not an empty document.
. "$KV_CLI_LIB"
kvbake -m "$demo" - -o out.kvc <&-
