# A store another process holds locked is refused at once with a clear error, and left as it was.
. "$KV_CLI_LIB"
echo "The code of Ada is 48613." > a.txt
echo "Bob lives in Paris." > b.txt
kvbake -m "$demo" -q a.txt -o store.kvc
before=$(sha256sum < store.kvc)
flock --nonblock store.kvc sleep 3 &
sleep 0.5
kvbake -m "$demo" -q --append b.txt -o store.kvc
echo "exit $?"
[ "$(sha256sum < store.kvc)" = "$before" ] && echo unchanged
wait
