# Text that is not UTF-8 is refused, naming the document and the byte; nothing is written.
. "$KV_CLI_LIB"
printf 'fine text\n' > good.txt
printf 'caf\xe9\n' > latin1.txt
kvbake -m "$demo" good.txt latin1.txt -o out.kvc
status=$?
[ ! -e out.kvc ] || echo "out.kvc exists"
exit $status
