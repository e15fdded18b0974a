# Outputs that are not plain new files (docs/reliability.md, Outputs): a symbolic link is written
# through to its file and stays a link; /dev/null and a FIFO are written in place and stay what
# they are; an output that is an input is refused before any work, the input untouched; a
# replaced file and an --append rewrite keep the file's mode.
. "$KV_CLI_LIB"
printf '{"id": "a", "text": "Ada lives in Oslo."}\n' > a.jsonl
printf '{"id": "b", "text": "Bob lives in Paris."}\n' > b.jsonl
bake() { kvbake -m "$demo" --no-bos -q "$@"; }
bake a.jsonl -o real.kvc
ln -s real.kvc link.kvc
bake b.jsonl -o link.kvc
echo "link: exit $?, $([ -L link.kvc ] && echo 'still a link'), real.kvc holds $(kvinspect show real.kvc | tail -n 1 | cut -d' ' -f1)"
bake a.jsonl -o /dev/null
echo "/dev/null: exit $?, $([ -c /dev/null ] && echo 'still a character device')"
mkfifo pipe.kvc
cat pipe.kvc > from-pipe.kvc &
bake a.jsonl -o pipe.kvc
echo "fifo: exit $?, $([ -p pipe.kvc ] && echo 'still a FIFO')"
wait
kvinspect check from-pipe.kvc >/dev/null && echo "what came through the FIFO checks"
cp a.jsonl a.copy
bake a.jsonl -o a.jsonl 2>&1
echo "exit $?"
cmp -s a.jsonl a.copy && echo "a.jsonl untouched"
chmod 640 real.kvc
bake a.jsonl -o real.kvc
echo "replaced: mode $(stat -c %a real.kvc)"
chmod 604 real.kvc
bake --append b.jsonl -o real.kvc
echo "appended: mode $(stat -c %a real.kvc), $(kvinspect show real.kvc | grep -c '^[ab] ') packets"
echo "temporary files left: $(ls -A | grep -c '^\.')"
