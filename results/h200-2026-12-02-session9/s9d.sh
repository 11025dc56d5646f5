source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3"
part r1b1 300 $B --batches 1 --max-tokens 128 --requests-per-batch 4 --repeats 4 --speculation fixed,adaptive,fixed/serial,adaptive/serial --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/r1b1
tar czf $OUT/r1b1.tgz -C /tmp r1b1
grep "^|" /tmp/r1b1/speed.md | cut -c1-330; grep "^served" $OUT/r1b1.log; cat $OUT/parts.txt | tail -1
