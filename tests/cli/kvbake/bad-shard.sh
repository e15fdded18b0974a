kvbake -m model.bin doc.txt --shard 2/2 -o out.kvc
