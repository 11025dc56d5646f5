source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --speculation fixed,adaptive"
part r1 330 $B --synthetic-acceptance 0.92,0.72,0.36 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out /tmp/r1
part mixb1 150 $B --workload mixed --batches 1 --max-tokens 128 --requests-per-batch 4 --repeats 3 --out /tmp/mixb1
for d in r1 mixb1; do grep "^|" /tmp/$d/speed.md | cut -c1-300; done
tar czf $OUT/res.tgz -C /tmp r1 mixb1 2>/dev/null; gzip -f $OUT/*.log
cat $OUT/parts.txt
