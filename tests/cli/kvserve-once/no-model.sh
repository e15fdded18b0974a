kvserve-once --prompt hello
