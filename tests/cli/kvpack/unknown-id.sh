# A packet id the file does not hold: a one-line error naming the ids it has, exit 1.
. "$KV_CLI_LIB"
printf 'Ada lives in Oslo.\n' > doc.txt
kvbake -m "$demo" --no-bos doc.txt -o doc.kvc -q
kvpack doc.kvc:nosuch -o out.kvc
