# --keep-going bakes the good documents and names every bad one on stderr: a malformed line, an
# empty text, a duplicate id, invalid UTF-8, a missing file and a directory.
. "$KV_CLI_LIB"
{
    echo '{"id": "good-1", "text": "The code of Ada is 48613."}'
    echo '{"id": "broken", "text": '
    echo '{"id": "empty", "text": ""}'
    echo '{"id": "good-1", "text": "A second document with the first id."}'
    echo '{"id": "good-2", "text": "Bob lives in Paris."}'
} > docs.jsonl
printf 'caf\xe9\n' > latin1.txt
mkdir folder
kvbake -m "$demo" --keep-going -q docs.jsonl latin1.txt missing.txt folder -o out.kvc
echo "exit $?"
kvinspect show out.kvc | grep -c '^good-'
