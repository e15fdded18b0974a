# --append adds packets to a store (creating it first), keeps the old ones, refuses an id the
# store already holds, and refuses a store of another model.
. "$KV_CLI_LIB"
echo "The code of Ada is 48613." > a.txt
echo "Bob lives in Paris." > b.txt
kvbake -m "$demo" -q --append a.txt -o store.kvc
kvbake -m "$demo" -q --append b.txt -o store.kvc
kvinspect show store.kvc | grep -o '^[ab]\.txt'
kvbake -m "$demo" -q --append a.txt -o store.kvc
echo "exit $?"
kvbake -m "$demo" -q --keep-going --append a.txt -o store.kvc
echo "exit $?"
kvbake -m "$demo" -q --append - -o - < a.txt
echo "exit $?"
kvinspect check store.kvc && ls -A | grep -v '^std'
