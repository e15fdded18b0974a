# --stats naming the prompt file (or the document) is refused before anything is read or
# written: the file is untouched.
. "$KV_CLI_LIB"
echo "Where does Ada live?" > p.txt
cp p.txt p.copy
kvserve-once -m "$demo" -n 1 --stats p.txt -f p.txt 2>&1
echo "exit $?"
kvserve-once -m "$demo" -n 1 --stats p.txt --document p.txt -p "Where?" 2>&1
echo "exit $?"
cmp -s p.txt p.copy && echo "p.txt untouched"
