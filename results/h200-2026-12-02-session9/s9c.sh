source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3"
part zero 330 $B --batches 1,8,32 --max-tokens 128 --requests-per-batch 4 --repeats 3 --speculation adaptive,fixed --synthetic-acceptance 0.02 --out /tmp/zero
tar czf $OUT/zero.tgz -C /tmp zero
part r1 230 $B --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --speculation fixed,adaptive,fixed/serial,adaptive/serial --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/r1
tar czf $OUT/r1.tgz -C /tmp r1
grep "^|" /tmp/zero/speed.md /tmp/r1/speed.md | cut -c1-330; grep -i "Traceback" $OUT/*.log | head -3; cat $OUT/parts.txt | tail -2
