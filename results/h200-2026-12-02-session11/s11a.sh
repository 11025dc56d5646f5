source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --speculation fixed,adaptive"
part mixb8 170 $B --workload mixed --batches 8 --max-tokens 96 --requests-per-batch 3 --repeats 2 --out /tmp/mixb8
part mixb32 210 $B --workload mixed --batches 32 --max-tokens 64 --requests-per-batch 3 --repeats 2 --out /tmp/mixb32
part near0b1 140 $B --synthetic-acceptance 0.02 --batches 1 --max-tokens 128 --requests-per-batch 4 --repeats 3 --out /tmp/near0b1
for d in mixb8 mixb32 near0b1; do grep "^|" /tmp/$d/speed.md | cut -c1-300; done
tar czf $OUT/res.tgz -C /tmp mixb8 mixb32 near0b1 2>/dev/null; gzip -f $OUT/*.log
cat $OUT/parts.txt
