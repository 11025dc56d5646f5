source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2"
part r1 200 $B --speculation fixed,adaptive,fixed/serial --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/r1
tar czf $OUT/r1.tgz -C /tmp r1
part zero 150 $B --speculation adaptive,fixed --synthetic-acceptance 0.02 --out /tmp/zero
tar czf $OUT/zero.tgz -C /tmp zero
grep "^|" /tmp/r1/speed.md /tmp/zero/speed.md | cut -c1-200; cat $OUT/parts.txt | tail -3
