# A store another process holds locked is refused at once with a clear error, and left as it was.
. "$KV_CLI_LIB"
echo "The code of Ada is 48613." > a.txt
echo "Bob lives in Paris." > b.txt
kvbake -m "$demo" -q a.txt -o store.kvc
before=$(sha256sum < store.kvc)
# The holder keeps the lock until kvbake has tried (however slowly it starts).
flock --nonblock store.kvc sh -c 'touch held; while [ ! -e done ]; do sleep 0.1; done' &
while [ ! -e held ]; do sleep 0.1; done
kvbake -m "$demo" -q --append b.txt -o store.kvc
echo "exit $?"
touch done
[ "$(sha256sum < store.kvc)" = "$before" ] && echo unchanged
wait
