# Processes appending to one store at once: each either succeeds or gets the lock error, and the
# store ends holding exactly the packets of those that succeeded, never a corrupt file.
. "$KV_CLI_LIB"
echo "The first document." > base.txt
kvbake -m "$demo" -q base.txt -o store.kvc
for round in 1 2 3; do
    pids=()
    for writer in 1 2 3; do
        echo "Round $round, writer $writer." > "r$round-w$writer.txt"
        kvbake -m "$demo" -q --append "r$round-w$writer.txt" -o store.kvc 2> "r$round-w$writer.err" &
        pids+=($!)
    done
    for i in 0 1 2; do
        if wait "${pids[$i]}"; then echo "r$round-w$((i + 1)).txt" >> succeeded
        elif ! grep -q "is locked" "r$round-w$((i + 1)).err"; then cat "r$round-w$((i + 1)).err"; fi
    done
done
kvinspect check store.kvc || exit 1
kvinspect show store.kvc | grep -o '^r[0-9]-w[0-9]\.txt' | sort > held
sort succeeded | cmp - held && echo "store holds exactly the successful appends"
[ -s succeeded ] && echo "at least one succeeded"
echo "$(ls -A | grep -c tmp) temporary files left"
