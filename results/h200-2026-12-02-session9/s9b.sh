source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --max-tokens 128 --requests-per-batch 4"
part zero 300 $B --batches 1,8 --repeats 3 --speculation adaptive,fixed --synthetic-acceptance 0.02 --out /tmp/zero
tar czf $OUT/zero.tgz -C /tmp zero
grep "^|" /tmp/zero/speed.md | cut -c1-400; grep -c "" $OUT/zero.log; grep -i "error\|Traceback" $OUT/zero.log | head; cat $OUT/parts.txt | tail -2
