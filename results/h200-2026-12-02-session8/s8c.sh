source .gpu/common.sh
rm -rf /tmp/old && mkdir -p /tmp/old && cp -a . /tmp/old/ && cp -r .gpu/old/. /tmp/old/ && rm -rf /tmp/old/checkpoints
part profnew 90 python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32 --top 60 --out /tmp/pnew
part profold 90 bash -c "cd /tmp/old && python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0 --batches 1,32 --max-tokens 32 --top 60 --out /tmp/pold"
tar czf $OUT/prof.tgz -C /tmp pnew pold
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --speculation fixed,adaptive --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2"
part r1 300 $B --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/r1
tar czf $OUT/r1.tgz -C /tmp r1
head -1 /tmp/pnew/*.txt /tmp/pold/*.txt; grep "^|" /tmp/r1/speed.md; cat $OUT/parts.txt
